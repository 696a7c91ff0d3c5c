"""A cluster of `mooncaked serve` processes on this host: what `mooncake up`, the cluster
tests and the cluster benchmark start.

Each node is a separate process with its own role, node id and API port (free
loopback ports below the ephemeral range, ports.py; a restart keeps them), sharing one
coordination backend: the `local`
backend in a directory of the work dir, or a single-member etcd the launcher
starts on loopback (`backend="etcd"`). With `hosts=True` each node (and etcd) runs in a
host of its own instead (hosts.py: a network namespace with its own address on a private
bridge, its link shaped to `link_rate`), binding and advertising that address with
`host_settings` as a node on a real host does. `start()` returns once every node answers
/health 200 (ready) and the elected conductor has heard from every node; `stop()` sends
SIGTERM (graceful drain), then SIGKILL to stragglers. Synchronous (subprocess,
urllib), so tests and CLIs use it without an event loop.

    with LocalCluster(workdir, [NodeSpec("cache", "c1", port=8000), NodeSpec("prefill", "p1"),
                                NodeSpec("decode", "d1")]) as cluster:
        print(cluster.api_url("c1"))
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from mooncaked.log import get_logger

from mooncaked.pdeathsig import die_with_parent
from mooncaked.ports import free_port
from mooncaked.wire.auth import auth_headers
from mooncaked.wire.auth import write_token_file
from mooncaked.coord.etcd_server import EtcdServer

from .hosts import Hosts

log = get_logger(__name__)


class ClusterStartError(RuntimeError):
    """A node exited or the cluster was not ready in time; the message has the log tail."""


@dataclass
class NodeSpec:
    """One node to start: role (prefill, decode, cache), id, API port (0: a free one),
    extra dotted settings for this node only (e.g. {"engine.kv_cache_bytes": 1 << 26}) and
    extra environment variables."""

    role: str
    node_id: str
    port: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def cluster_specs(cache: int = 1, prefill: int = 1, decode: int = 1, coupled: int = 0,
                  port: int = 0, cpp: int = 0) -> list[NodeSpec]:
    """The nodes `mooncake up` starts: cache nodes (the first serves the public API on
    `port`, 0: a free one), then either prefill and decode nodes or, with coupled > 0,
    that many coupled nodes (role all, cluster.coupled) instead. With cpp = N > 1 the
    prefill nodes form prefill // N CPP groups of N stages ("g0", "g1", ...; nodes
    "g0s0", "g0s1", ...), the remainder staying single prefill nodes. Without cache nodes
    the first model node serves the API on `port`.
    Raises: ValueError when cpp > 1 exceeds prefill."""
    nodes = [NodeSpec("cache", f"cache{i}", port=port if i == 0 else 0) for i in range(cache)]
    if coupled:
        model = [NodeSpec("all", f"coupled{i}", settings={"cluster.coupled": True})
                 for i in range(coupled)]
    else:
        groups = prefill // cpp if cpp > 1 else 0
        if cpp > 1 and not groups:
            raise ValueError(f"--cpp {cpp} needs at least {cpp} prefill nodes (--prefill)")
        model = [NodeSpec("prefill", f"g{g}s{k}", settings={"cpp.group": f"g{g}", "cpp.stage": k,
                                                            "cpp.stages": cpp})
                 for g in range(groups) for k in range(cpp)]
        model += [NodeSpec("prefill", f"prefill{i}") for i in range(prefill - groups * cpp)]
        model += [NodeSpec("decode", f"decode{i}") for i in range(decode)]
    if not cache and model:
        model[0].port = port
    return nodes + model


def host_settings(address: str) -> dict[str, Any]:
    """The dotted settings of a node on a host whose cluster-network address is `address`:
    the public API, the control plane and the transfer engine's data server listen there
    and peers dial it (docs/cluster.md, multi-host)."""
    return {"server.host": address, "cluster.rpc_host": address, "transfer.host": address}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return orjson.dumps(v).decode()          # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def write_toml(path: Path, data: dict[str, dict[str, Any]]) -> None:
    """Writes {section: {key: value}} as TOML (one level of sections, like config.toml)."""
    lines = []
    for section, keys in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    path.write_text("\n".join(lines))


def _merge(base: dict, dotted: dict[str, Any]) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for key, value in dotted.items():
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def _daemon_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "mooncaked"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from mooncaked.cli.daemon import main; main()"]


# Control address -> cluster token of the nodes this process's LocalClusters started, so
# that control_call (tests, tools) reaches them without passing the token around.
_TOKENS: dict[str, str] = {}


def control_call(addr: str, method: str, payload: Any = None, timeout_s: float = 5.0,
                 token: str | None = None) -> Any:
    """One control RPC (POST /control/<method>) from synchronous code, carrying the
    cluster token (given, or the one of the LocalCluster that started the node at addr).

    Raises: OSError when the peer cannot be reached; RuntimeError with the remote error.
    """

    token = token if token is not None else _TOKENS.get(addr)
    req = urllib.request.Request(f"http://{addr}/control/{method}", data=orjson.dumps(payload),
                                 headers={"Content-Type": "application/json",
                                          **auth_headers(token)}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        body = orjson.loads(e.read() or b"{}")
        err = body.get("error") or {}
        raise RuntimeError(f"{method} on {addr}: {err.get('type')}: {err.get('message')}") from None
    return body["result"]


class LocalCluster:
    """Starts, watches and stops the nodes of a one-host cluster (see the module doc).

    Args:
        workdir: directory for configs, logs, the local backend's state and etcd's data.
        nodes: what to start.
        backend: "local" or "etcd" (starts its own etcd on loopback, unless etcd_endpoint).
        etcd_endpoint: client URL of an etcd already running that the etcd backend uses
            instead of starting one (neither started nor stopped here; give the nodes a
            `cluster.key_prefix` of their own when other clusters share it).
        settings: dotted settings for every node (e.g. {"cluster.lease_ttl_s": 2.0}).
        base_config: a TOML file every node starts from (the dotted settings override it).
        log_level: of the nodes.
        die_with_parent: the nodes and etcd get SIGTERM when the thread that started them
            ends (pdeathsig.py; `mooncake up` sets it, so that killing it leaves no orphans).
        hosts: each node, and etcd, in a host of its own (hosts.Hosts; needs root), its
            address from host_settings; the hosts are named after the nodes (and "etcd").
        link_rate: with hosts, every host's link shaped to this tc rate ("1gbit").
    The cluster's token is <workdir>/token (created once, mode 0600); each node's control
    plane listens on its own loopback port (`control(node_id)`).
    """

    def __init__(self, workdir: str | Path, nodes: list[NodeSpec], *, backend: str = "local",
                 settings: dict[str, Any] | None = None, base_config: str | Path | None = None,
                 log_level: str = "info", die_with_parent: bool = False,
                 etcd_endpoint: str | None = None, hosts: bool = False,
                 link_rate: str | None = None):
        self.workdir = Path(workdir)
        self.nodes = {n.node_id: n for n in nodes}
        if len(self.nodes) != len(nodes):
            raise ValueError("node ids must be unique")
        self.backend = backend
        self.settings = dict(settings or {})
        self.base = tomllib.loads(Path(base_config).read_text()) if base_config else {}
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.rpc_ports: dict[str, int] = {}
        self.etcd: Any = None
        self.etcd_endpoint = etcd_endpoint
        self.die_with_parent = die_with_parent
        self.token = ""
        self.use_hosts = hosts
        self.link_rate = link_rate
        self.hosts: Hosts | None = None

    # ------------------------------------------------------------------ addresses

    def address(self, node_id: str) -> str:
        """The address a node binds and advertises: its host's, or 127.0.0.1 without hosts."""
        return self.hosts.address(node_id) if self.hosts is not None else "127.0.0.1"

    def api_url(self, node_id: str) -> str:
        """http://ADDRESS:PORT of a node's API (reachable from this process's namespace)."""
        return f"http://{self.address(node_id)}:{self.ports[node_id]}"

    def control(self, node_id: str) -> str:
        """host:port of a node's control plane (its own port, apart from the API)."""
        return f"{self.address(node_id)}:{self.rpc_ports[node_id]}"

    @property
    def token_path(self) -> Path:
        """The cluster's token file."""
        return self.workdir / "token"

    def log_path(self, node_id: str) -> Path:
        return self.workdir / f"{node_id}.log"

    def log_tail(self, node_id: str, n: int = 3000) -> str:
        p = self.log_path(node_id)
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def coordination(self) -> dict[str, Any]:
        """The dotted [cluster] settings every node (and `mooncake ctl`) uses."""
        out: dict[str, Any] = {"cluster.backend": self.backend,
                               "cluster.token_file": str(self.token_path)}
        if self.backend == "local":
            out["cluster.state_dir"] = str(self.workdir / "coord")
        else:
            out["cluster.etcd_endpoints"] = [self.etcd_endpoint or self.etcd.endpoint]
        return out

    def write_ctl_config(self, also_default: bool = False) -> Path:
        """Writes <workdir>/cluster.toml with the [cluster] settings `mooncake ctl -c` needs."""
        path = self.workdir / "cluster.toml"
        write_toml(path, _merge({}, {**self.coordination(),
                                     **{k: v for k, v in self.settings.items()
                                        if k.startswith("cluster.")}}))
        if also_default:
            default = default_ctl_config_path()
            default.parent.mkdir(parents=True, exist_ok=True)
            default.write_bytes(path.read_bytes())
        return path

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 300.0) -> "LocalCluster":
        """Starts every node and waits (at most timeout_s) until the cluster serves.

        Raises: ClusterStartError (with the failing node's log tail); CoordinationError
        when etcd cannot start. Whatever was started is stopped before raising.
        RuntimeError, stopping nothing, when a node of this cluster still runs (a second
        start: `with LocalCluster(...)` has started it already).
        """
        running = sorted(n for n, p in self.procs.items() if p.poll() is None)
        if running:
            raise RuntimeError(f"the cluster is running ({', '.join(running)}): a second start() would "
                               f"leave those processes behind; stop() it first")
        try:
            self.start_backend()
            for spec in self.nodes.values():
                self.start_node(spec.node_id)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_backend(self) -> None:
        """Creates the work dir, the hosts (with `hosts`) and, for the etcd backend without
        etcd_endpoint, starts etcd (idempotent, on a host of its own with `hosts`).
        Raises: CoordinationError when etcd cannot start; HostsError."""

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = write_token_file(self.token_path)
        if self.use_hosts and self.hosts is None:
            names = (["etcd"] if self.backend == "etcd" and not self.etcd_endpoint else [])
            self.hosts = Hosts(names + list(self.nodes), link_rate=self.link_rate).start()
        if self.backend == "etcd" and self.etcd is None and not self.etcd_endpoint:
            where = ({"host": self.hosts.address("etcd"),
                      "prefix": tuple(self.hosts.command("etcd", []))} if self.hosts else {})
            self.etcd = EtcdServer(self.workdir / "etcd", die_with_parent=self.die_with_parent,
                                   **where).start()

    def start_node(self, node_id: str) -> subprocess.Popen:
        """(Re)starts one node's process (same id, same port if it had one).

        Raises: RuntimeError when the node's process still runs (`restart_node` stops it
        first; a second process would be left behind)."""
        old = self.procs.get(node_id)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"node {node_id} still runs (pid {old.pid}): restart_node() or kill() it first")
        spec = self.nodes[node_id]
        # every port handed out, and every node's fixed API port (not started yet, maybe)
        taken = {*self.ports.values(), *self.rpc_ports.values(),
                 *(n.port for n in self.nodes.values() if n.port)}
        port = self.ports.get(node_id) or spec.port or free_port(exclude=taken)
        self.ports[node_id] = port
        rpc_port = self.rpc_ports.get(node_id) or free_port(exclude=taken | {port})
        data = _merge(self.base, {**self.coordination(), "cluster.rpc_port": rpc_port,
                                  **host_settings(self.address(node_id)),
                                  **self.settings, **spec.settings,
                                  "node.state_dir": str(self.workdir / "state" / node_id),
                                  "log.level": self.log_level})
        rpc_port = int(data["cluster"]["rpc_port"])
        self.rpc_ports[node_id] = rpc_port
        _TOKENS[self.control(node_id)] = self.token
        cfg = self.workdir / f"{node_id}.toml"
        write_toml(cfg, data)
        cmd = [*_daemon_cmd(), "serve", "--config", str(cfg), "--role", spec.role,
               "--node-id", node_id, "--host", self.address(node_id), "--port", str(port)]
        if self.hosts is not None:
            cmd = self.hosts.command(node_id, cmd)
        with self.log_path(node_id).open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **spec.env} if spec.env else None,
                                    preexec_fn=die_with_parent() if self.die_with_parent
                                    else None)
        self.procs[node_id] = proc
        log.info("node_spawned", node=node_id, role=spec.role, port=port, pid=proc.pid)
        return proc

    def _probe(self, node_id: str, path: str = "/health") -> bool:
        """True when the node's GET `path` answers 200 (/livez: up; /health: ready)."""
        try:
            with urllib.request.urlopen(f"{self.api_url(node_id)}{path}", timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def _up(self, want: list[str]) -> bool:
        """Every node in `want` is alive (/livez); ready (/health) too once the running
        nodes include a prefill and a decode node, without which no node is ready."""
        roles = {self.nodes[n].role for n, p in self.procs.items() if p.poll() is None}
        path = "/health" if {"prefill", "decode"} <= roles else "/livez"
        return all(self._probe(n, path) for n in want)

    def status(self) -> dict | None:
        """The conductor's status (via the first live node), or None when unavailable."""
        for nid in self.procs:
            if self.procs[nid].poll() is not None:
                continue
            try:
                st = control_call(self.control(nid), "node.status", timeout_s=2.0)
                leader = st.get("leader")
                if not leader or leader not in self.ports:
                    continue
                return control_call(self.control(leader), "conductor.status", timeout_s=2.0)
            except (OSError, RuntimeError, KeyError, ValueError):
                continue
        return None

    def wait_ready(self, timeout_s: float = 300.0, nodes: list[str] | None = None,
                   reported_since: float | None = None) -> dict:
        """Waits until `nodes` (default: every running one) answer /health 200 (only /livez
        while no prefill or decode node runs: no node is ready then) and the conductor
        has a report from each (with `reported_since`, a time.monotonic(): one sent after
        it, so a restarted node's old reports do not count); returns the conductor's status.

        Raises: ClusterStartError when a node exits or time runs out.
        """
        want = nodes or [n for n, p in self.procs.items() if p.poll() is None]
        deadline = time.monotonic() + timeout_s

        def reported(st: dict, nid: str, asked: float) -> bool:
            age = (st["nodes"].get(nid) or {}).get("report_age_s")
            # the report was sent at (the conductor's now - age) >= asked - age
            return age is not None and (reported_since is None or asked - age > reported_since)

        while True:
            for nid in want:
                rc = self.procs[nid].poll()
                if rc is not None:
                    raise ClusterStartError(f"node {nid} exited with {rc}:\n{self.log_tail(nid)}")
            if self._up(want):
                asked = time.monotonic()
                st = self.status()
                if st is not None and all(reported(st, n, asked) for n in want):
                    return st
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.log_tail(n, 1500)}" for n in want)
                raise ClusterStartError(f"cluster not ready after {timeout_s} s\n{tails}")
            time.sleep(0.25)   # poll interval; readiness itself is what the nodes answer

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Sends sig to a node's process group (kill -9 by default) and reaps it if it was
        SIGKILL."""
        proc = self.procs[node_id]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            if sig == signal.SIGKILL:
                proc.wait(10)

    def restart_node(self, node_id: str, timeout_s: float = 300.0,
                     stop_timeout_s: float = 30.0) -> dict:
        """Starts a node again (same id, port and settings) and waits until it serves.

        A node that still runs is stopped first (SIGTERM: it drains and leaves; SIGKILL after
        stop_timeout_s). Then waits, at most timeout_s, until it answers /health and the
        conductor has a report it sent after the restart. Returns the conductor's status.
        Raises: ClusterStartError when the node exits or time runs out.
        """
        proc = self.procs.get(node_id)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(stop_timeout_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        started = time.monotonic()
        self.start_node(node_id)
        return self.wait_ready(timeout_s, nodes=[node_id], reported_since=started)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to every node (they drain and leave), SIGKILL after timeout_s; stops etcd.
        Never raises."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self.hosts is not None:
            self.hosts.stop()
            self.hosts = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["ClusterStartError", "LocalCluster", "NodeSpec", "cluster_specs", "control_call",
           "host_settings", "write_toml"]


def default_ctl_config_path() -> Path:
    """Where `mooncake up` leaves its cluster's ctl settings while it runs, so that a plain
    `mooncake ctl status` (no -c) finds the local cluster: $XDG_RUNTIME_DIR/mooncake/up.toml,
    else ~/.cache/mooncake/up.toml."""
    import os  # noqa: PLC0415

    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache")
    return Path(base) / "mooncake" / "up.toml"
