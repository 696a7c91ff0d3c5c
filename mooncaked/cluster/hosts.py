"""Hosts on one machine: each a Linux network namespace with its own address on a private
bridge, its link optionally shaped, links cut and healed at will (`mooncake up --hosts`,
the partition tests).

Layout of one run (tag T: 5 random hex digits, so two runs never collide):

    root namespace: bridge mhTbr, address <subnet>.1/24 (the gateway: the root namespace
                    reaches every host there, e.g. a node's API)
    host i:         namespace mhT-<name>, loopback up, eth0 = one end of a veth pair
                    whose other end (mhTv<i>) is a port of the bridge; address <subnet>.<i+2>

The subnet is a private 10.x.y.0/24 picked per run, clear of every route of the root
namespace and of every other live run. The namespaces have no default route: traffic from
them reaches the bridge's subnet and nothing else.

Shaping (`shape`) puts a `tc tbf` qdisc on both ends of a host's veth (egress of eth0:
what the host sends; egress of the bridge port: what it receives), with a burst of
max(2 ms of the rate, 128 KiB) so that GSO packets (up to 64 KiB) pass and a 1 MiB
transfer gets at least 90% of the rate, and a 20 ms queue.

Cutting (`cut`) is silent, as a real partition: a permanent neighbour entry pointing the
peer's address at a MAC address nobody has, on both sides, so packets leave and are
dropped by the bridge (TCP retransmits and times out; nothing is refused). This kernel
has neither tc filter actions nor netem nor iptables; a blackhole route would fail
connect() at once (EINVAL), which is not what a partition looks like. `heal` deletes the
entries (ARP resolves again). The gateway (the root namespace) is cut like any host, by
the name `GATEWAY`.

Clean-up: `stop()` (also on Ctrl-C through the context manager) deletes the namespaces and
the bridge (the veth pairs go with them). Before creating anything, a run writes a record
(its pid, the pid's start time, what it will create) under RECORD_DIR; `start()` first
sweeps the records whose owner is dead (kill -9 included) and deletes what they list, also
killing processes left inside their namespaces.

Needs root (CAP_NET_ADMIN) and iproute2's `ip` and `tc`; HostsError says so in one line.
Synchronous (subprocess with checked errors): iproute2 is what an operator types, and it
needs no library of its own.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mooncaked.log import get_logger

log = get_logger(__name__)

RECORD_DIR = Path("/run/mooncaked-hosts")
GATEWAY = "gateway"                      # the root namespace, as a party to cut()
_BOGUS_MAC = "02:00:00:00:00:01"         # locally administered, on no interface we make
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class HostsError(RuntimeError):
    """A host set-up step failed, or this process may not make namespaces (not root)."""


def parse_rate(rate: str) -> int:
    """A tc rate ("1gbit", "100mbit", "500kbit", "2.5gbit") -> bits per second.
    Raises: ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?bit)\s*", rate.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: expected e.g. 1gbit, 100mbit, 500kbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def tbf_params(rate_bps: int) -> tuple[int, str]:
    """(burst in bytes, latency) of the tbf qdisc for a rate in bits/s: 2 ms of the rate but
    at least 128 KiB (two GSO packets), a 20 ms queue."""
    return max(rate_bps // 8 // 500, 128 << 10), "20ms"


@dataclass(frozen=True)
class Host:
    """One host: its name, network namespace, address on the bridge, and the bridge-side
    end of its veth pair (its end inside the namespace is eth0)."""

    name: str
    netns: str
    address: str
    port_dev: str


def _run(*cmd: str) -> str:
    """Runs one iproute2 command; returns stdout. Raises: HostsError with its stderr."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"{' '.join(cmd)}: {e}") from None
    if p.returncode:
        raise HostsError(f"{' '.join(cmd)}: {p.stderr.strip() or f'exit {p.returncode}'}")
    return p.stdout


def _quiet(*cmd: str) -> None:
    """Runs a clean-up command whose failure (already gone) does not matter."""
    subprocess.run(cmd, capture_output=True, timeout=30, check=False)


def require_root() -> None:
    """Raises HostsError (one line) unless this process can make network namespaces."""
    if os.geteuid() != 0:
        raise HostsError("--hosts needs root (network namespaces, veth pairs, tc): run it as "
                         "root, or without --hosts")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise HostsError(f"--hosts needs iproute2's `{tool}` on PATH")


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(record: dict) -> bool:
    return _start_time(record["pid"]) == record["start_time"]


def _remove(record: dict) -> None:
    """Deletes what a record lists (processes left inside its namespaces first)."""
    for ns in record["netns"]:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _quiet("ip", "netns", "del", ns)
    _quiet("ip", "link", "del", record["bridge"])


def sweep(record_dir: Path = RECORD_DIR) -> list[str]:
    """Deletes the namespaces and bridges of runs whose owner process is dead (killed -9,
    say). Returns the tags swept. Live runs (other engineers', other tests') are left alone."""
    swept = []
    for path in sorted(record_dir.glob("*.json")) if record_dir.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(record):
            continue
        _remove(record)
        path.unlink(missing_ok=True)
        swept.append(record["tag"])
        log.info("hosts_swept", tag=record["tag"], owner=record["pid"])
    return swept


def _taken_subnets(record_dir: Path) -> list[ipaddress.IPv4Network]:
    """Networks in use: the root namespace's routes and other runs' subnets."""
    nets = []
    for route in json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                nets.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                pass
    for path in record_dir.glob("*.json") if record_dir.is_dir() else []:
        try:
            nets.append(ipaddress.ip_network(json.loads(path.read_text())["subnet"]))
        except (OSError, ValueError, KeyError):
            pass
    return nets


def pick_subnet(taken: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 (x in 200..254) that overlaps none of `taken`.
    Raises: HostsError when 64 draws all collide."""
    for _ in range(64):
        net = ipaddress.ip_network(f"10.{200 + secrets.randbelow(55)}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostsError("no free private /24 for the hosts' bridge")


class Hosts:
    """N hosts on this machine (see the module doc). A context manager: `start()` on enter,
    `stop()` on exit, Ctrl-C included.

        with Hosts(["etcd", "cache0", "prefill0", "decode0"], link_rate="1gbit") as hosts:
            proc = hosts.popen("decode0", ["mooncaked", "serve", ...])
            hosts.cut("prefill0", "decode0")
            hosts.heal()

    Args:
        names: host names (letters, digits, '-', '_'; unique).
        link_rate: shape every host's link to this tc rate ("1gbit"), or None (unshaped).
        record_dir: where runs record what they made (for the sweep after a kill -9).
    Raises (start): HostsError when not root or a step fails (what was made is removed).
    """

    def __init__(self, names: list[str], link_rate: str | None = None,
                 record_dir: Path = RECORD_DIR):
        if len(set(names)) != len(names) or not names or len(names) > 250:
            raise ValueError("host names must be 1..250 unique names")
        for n in names:
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", n):
                raise ValueError(f"host name {n!r}: letters, digits, '-', '_' only")
        self.names = list(names)
        self.link_rate = link_rate
        self.rate_bps = parse_rate(link_rate) if link_rate else None
        self.record_dir = Path(record_dir)
        self.tag = secrets.token_hex(3)[:5]
        self.bridge = f"mh{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self.gateway = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self._cuts: set[tuple[str, str]] = set()
        self._started = False

    @property
    def record_path(self) -> Path:
        """This run's record file."""
        return self.record_dir / f"{self.tag}.json"

    def address(self, name: str) -> str:
        """A host's address (GATEWAY: the root namespace's address on the bridge)."""
        return self.gateway if name == GATEWAY else self.hosts[name].address

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Hosts":
        """Sweeps dead runs' leftovers, then makes the bridge and every host.
        Raises: HostsError (whatever was made is removed first)."""
        require_root()
        self.record_dir.mkdir(parents=True, exist_ok=True)
        sweep(self.record_dir)
        self.subnet = pick_subnet(_taken_subnets(self.record_dir))
        addrs = list(self.subnet.hosts())
        self.gateway = str(addrs[0])
        self.hosts = {n: Host(n, f"mh{self.tag}-{n}", str(addrs[i + 1]), f"mh{self.tag}v{i}")
                      for i, n in enumerate(self.names)}
        self.record_path.write_text(json.dumps({
            "tag": self.tag, "pid": os.getpid(), "start_time": _start_time(os.getpid()),
            "subnet": str(self.subnet), "bridge": self.bridge,
            "netns": [h.netns for h in self.hosts.values()]}))
        self._started = True
        try:
            plen = self.subnet.prefixlen
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for h in self.hosts.values():
                _run("ip", "netns", "add", h.netns)
                inner = f"mh{self.tag}i"
                _run("ip", "link", "add", h.port_dev, "type", "veth", "peer", "name", inner,
                     "netns", h.netns)
                _run("ip", "link", "set", h.port_dev, "master", self.bridge, "up")
                _run("ip", "-n", h.netns, "link", "set", inner, "name", "eth0")
                _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/{plen}", "dev", "eth0")
                _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
                _run("ip", "-n", h.netns, "link", "set", "lo", "up")
                if self.rate_bps:
                    self.shape(h.name, self.link_rate)
        except BaseException:
            self.stop()
            raise
        log.info("hosts_started", tag=self.tag, subnet=str(self.subnet), hosts=len(self.hosts),
                 link_rate=self.link_rate or "unshaped")
        return self

    def stop(self) -> None:
        """Deletes every namespace and the bridge this run made, and its record. Processes
        still inside a namespace are killed (stop them first to let them drain). Never raises."""
        if not self._started:
            return
        _remove({"netns": [h.netns for h in self.hosts.values()], "bridge": self.bridge})
        self.record_path.unlink(missing_ok=True)
        self._started = False
        log.info("hosts_stopped", tag=self.tag)

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ processes

    def command(self, name: str, cmd: list[str]) -> list[str]:
        """`cmd` wrapped to run inside host `name` (ip netns exec)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *cmd]

    def popen(self, name: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen of `cmd` inside host `name` (kwargs passed through)."""
        return subprocess.Popen(self.command(name, cmd), **kwargs)

    # ------------------------------------------------------------------ links

    def shape(self, name: str, rate: str | None) -> None:
        """Shapes host `name`'s link to `rate` in both directions (tc tbf on both veth ends),
        or removes the shaping (rate None). Raises: HostsError, ValueError (bad rate)."""
        h = self.hosts[name]
        for where, dev in ((("-n", h.netns), "eth0"), ((), h.port_dev)):
            _quiet("tc", *where, "qdisc", "del", "dev", dev, "root")
            if rate:
                burst, latency = tbf_params(parse_rate(rate))
                _run("tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", latency)

    def _neigh(self, name: str) -> tuple[tuple[str, ...], str]:
        """(`ip` namespace arguments, device) of a party's side of the bridge."""
        if name == GATEWAY:
            return (), self.bridge
        return ("-n", self.hosts[name].netns), "eth0"

    def cut(self, a: str, b: str) -> None:
        """Cuts the link between two hosts (or a host and GATEWAY) silently, both ways.
        Raises: HostsError, KeyError (unknown host)."""
        if a == b:
            raise ValueError("cut needs two different hosts")
        for src, dst in ((a, b), (b, a)):
            ns, dev = self._neigh(src)
            _run("ip", *ns, "neigh", "replace", self.address(dst), "lladdr", _BOGUS_MAC,
                 "nud", "permanent", "dev", dev)
        self._cuts.add((min(a, b), max(a, b)))

    def partition(self, side_a: list[str], side_b: list[str]) -> None:
        """Cuts every link between the two sides (a host may be GATEWAY)."""
        for a in side_a:
            for b in side_b:
                self.cut(a, b)

    def isolate(self, name: str) -> None:
        """Cuts host `name` from every other host and from the root namespace."""
        self.partition([name], [n for n in [*self.names, GATEWAY] if n != name])

    def cuts(self) -> set[tuple[str, str]]:
        """The links cut now, as sorted name pairs."""
        return set(self._cuts)

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Heals the link a-b, or (no arguments) every cut link. Raises: HostsError."""
        pairs = [(min(a, b), max(a, b))] if a is not None and b is not None else list(self._cuts)
        for x, y in pairs:
            for src, dst in ((x, y), (y, x)):
                ns, dev = self._neigh(src)
                _quiet("ip", *ns, "neigh", "del", self.address(dst), "dev", dev)
            self._cuts.discard((x, y))


__all__ = ["GATEWAY", "Host", "Hosts", "HostsError", "RECORD_DIR", "parse_rate", "pick_subnet",
           "require_root", "sweep", "tbf_params"]
