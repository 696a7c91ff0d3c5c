"""Start and stop a single-member etcd on loopback with its own data directory.

For tests, CI and `mooncake up --backend etcd`: never the packaged etcd.service on
2379/2380. Install the binary with mooncaked/coord/install_etcd.sh (Debian's
etcd-server 3.4).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson

from ..log import get_logger
from ..pdeathsig import die_with_parent
from ..ports import free_port
from mooncaked.wire.errors import CoordinationError

log = get_logger(__name__)


def etcd_binary() -> str | None:
    """Path of the etcd server binary, or None when it is not installed."""
    found = shutil.which("etcd")
    if found:
        return found
    for p in ("/usr/bin/etcd", "/usr/local/bin/etcd"):
        if os.access(p, os.X_OK):
            return p
    return None


class EtcdServer:
    """One etcd member listening on loopback.

    Args:
        data_dir: etcd's data directory (created; reuse it to keep the data).
        client_port, peer_port: 0 picks free ports.
        binary: etcd binary; None finds it on PATH.
        host: the address it listens on and advertises.
        prefix: a command prefix that runs it elsewhere, e.g. inside a network namespace
            (hosts.Hosts.command: `ip netns exec NS`); its ports are then picked on
            loopback (a fresh namespace has every port free).
    Use: `with EtcdServer(tmp) as etcd: settings.etcd_endpoints = [etcd.endpoint]`.
    Raises (start): CoordinationError if etcd is missing, exits, or is not healthy in time.
    """

    def __init__(self, data_dir: str | Path, client_port: int = 0, peer_port: int = 0,
                 binary: str | None = None, host: str = "127.0.0.1",
                 die_with_parent: bool = False, prefix: tuple[str, ...] = ()):
        self.prefix = tuple(prefix)
        self.data_dir = Path(data_dir)
        self.die_with_parent = die_with_parent   # pdeathsig.py: ends with its starter
        self.host = host
        self.client_port, self.peer_port = client_port, peer_port
        self.binary = binary or etcd_binary()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. http://127.0.0.1:41379."""
        return f"http://{self.host}:{self.client_port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=0.5) as r:
                return orjson.loads(r.read()).get("health") == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def start(self, timeout_s: float = 20.0) -> "EtcdServer":
        """Starts etcd and waits until /health answers true (at most timeout_s seconds)."""
        if self.binary is None:
            raise CoordinationError("etcd binary not found: run mooncaked/coord/install_etcd.sh "
                                    "(apt-get install etcd-server)")
        fixed = bool(self.client_port and self.peer_port)
        for attempt in range(1 if fixed else 3):   # a picked port may be taken meanwhile
            if not fixed:
                pick = "127.0.0.1" if self.prefix else self.host
                self.client_port = free_port(pick)
                self.peer_port = free_port(pick, exclude={self.client_port})
            if self._try_start(timeout_s):
                return self
            log.warning("etcd_start_retry", attempt=attempt + 1, log=str(self.log_path))
        raise CoordinationError(f"etcd did not become healthy on {self.endpoint}; see "
                                f"{self.log_path}: {self._log_tail()}")

    def _try_start(self, timeout_s: float) -> bool:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        client, peer = self.endpoint, f"http://{self.host}:{self.peer_port}"
        # ETCD_* variables would override flags; start from a clean environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        cmd = [*self.prefix, self.binary, "--name", "mooncaked", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"mooncaked={peer}", "--logger", "zap",
               "--log-level", "warn"]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent() if self.die_with_parent
                                         else None)
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            if self._healthy():
                log.info("etcd_started", endpoint=self.endpoint, pid=self.proc.pid)
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        self.stop()
        return False

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-500:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops etcd (SIGTERM, then SIGKILL after timeout_s). Never raises."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["EtcdServer", "etcd_binary"]
