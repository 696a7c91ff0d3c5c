"""A minimal cluster member process, for the coordination and RPC tests (moved out of the
product, issue 31: only tests used it).

    python tests/cluster_probe.py --node-id n1 --backend local --state-dir DIR \
        [--etcd http://127.0.0.1:2379] [--ttl 2] [--heartbeat 0.5] [--campaign] \
        [--watch-members] [--rpc-port 0]

It registers `node_id`, optionally campaigns for the conductor election and serves a
few control methods (echo, sleep, fail, whoami), and prints one JSON object per line
on stdout as things happen:

    {"event": "ready", "node": ..., "session": ..., "rpc": "127.0.0.1:PORT" | null}
    {"event": "elected", "node": ..., "t": <unix s>}
    {"event": "lost_leadership", ...}
    {"event": "member", "kind": "join"|"leave"|"rejoin"|"update", "node": ..., "t": ...}

`ProbeProcess` runs one as a child and collects its events.
SIGTERM/SIGINT close it gracefully (resign, revoke the lease); kill -9 leaves its
lease to expire, which is what the failover tests exercise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from mooncaked.config import ClusterSettings
from mooncaked.coord.factory import make_coordinator
from mooncaked.wire.rpc import ControlServer


def emit(event: str, **fields: Any) -> None:
    """Prints one JSON event line on stdout and flushes it."""
    sys.stdout.write(orjson.dumps({"event": event, "t": time.time(), **fields}).decode() + "\n")
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> None:
    settings = ClusterSettings(backend=args.backend, state_dir=args.state_dir,
                               etcd_endpoints=args.etcd or ["http://127.0.0.1:2379"],
                               lease_ttl_s=args.ttl, heartbeat_interval_s=args.heartbeat,
                               poll_interval_s=args.poll, op_timeout_s=args.op_timeout,
                               key_prefix=args.key_prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server = None
    rpc_addr = None
    if args.rpc_port is not None:
        server = ControlServer()

        async def echo(p):
            return p

        async def sleep(p):
            await asyncio.sleep(float(p["s"]))
            return "slept"

        async def fail(p):
            raise RuntimeError(f"asked to fail: {p}")

        async def whoami(p):
            return args.node_id

        for name, h in (("echo", echo), ("sleep", sleep), ("fail", fail), ("whoami", whoami)):
            server.add_handler(name, h)
        host, port = await server.start("127.0.0.1", args.rpc_port)
        rpc_addr = f"{host}:{port}"

    tasks: list[asyncio.Task] = []
    async with make_coordinator(settings) as coord:
        await coord.register(args.node_id, {"rpc": rpc_addr, "pid": os.getpid()})
        emit("ready", node=args.node_id, session=coord.session_id, rpc=rpc_addr)

        if args.watch_members:
            async def members():
                async for ev in coord.watch_members():
                    emit("member", kind=ev.kind, node=ev.member.node_id,
                         incarnation=ev.member.incarnation)
            tasks.append(asyncio.create_task(members()))

        if args.campaign:
            async def lead():
                while True:
                    leadership = await coord.campaign(args.node_id)
                    emit("elected", node=args.node_id, session=coord.session_id)
                    await leadership.wait_lost()
                    emit("lost_leadership", node=args.node_id)
            tasks.append(asyncio.create_task(lead()))

        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if server is not None:
        await server.stop()
    emit("stopped", node=args.node_id)


class ProbeProcess:
    """Runs `python tests/cluster_probe.py` as a child process and collects its events.

    For tests of membership, failover and RPC with real processes. Always stop it
    (`with ProbeProcess(...) as p:` or `p.stop()`); `kill9()` simulates a crash.
    """

    def __init__(self, node_id: str, *, backend: str = "local", state_dir: str = "",
                 etcd: list[str] | None = None, key_prefix: str = "/mooncaked/",
                 ttl: float = 2.0, heartbeat: float = 0.5,
                 poll: float = 0.1, campaign: bool = False, watch_members: bool = False,
                 rpc_port: int | None = None):
        self.node_id = node_id
        self.cmd = [sys.executable, str(Path(__file__).resolve()), "--node-id", node_id,
                    "--backend", backend, "--ttl", str(ttl), "--heartbeat", str(heartbeat),
                    "--poll", str(poll), "--key-prefix", key_prefix]
        if state_dir:
            self.cmd += ["--state-dir", state_dir]
        for url in etcd or []:
            self.cmd += ["--etcd", url]
        if campaign:
            self.cmd.append("--campaign")
        if watch_members:
            self.cmd.append("--watch-members")
        if rpc_port is not None:
            self.cmd += ["--rpc-port", str(rpc_port)]
        self.proc: subprocess.Popen | None = None
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._stderr = tempfile.TemporaryFile()

    def start(self, ready_timeout_s: float = 15.0) -> "ProbeProcess":
        """Starts the child and waits for its "ready" event; returns self."""
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self.wait_for("ready", ready_timeout_s)
        except BaseException:
            self.kill9()
            raise
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, event: str, timeout_s: float, **match: Any) -> dict:
        """The first event named `event` whose fields equal `match`, waiting at most timeout_s.

        Raises: TimeoutError (with the child's stderr tail) if none comes in time.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for ev in self.events:
                    if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        raise TimeoutError(f"probe {self.node_id}: no {event} {match} within {timeout_s} s; "
                           f"exit={self.proc.poll() if self.proc else None}; stderr: "
                           f"{self.stderr_tail()}")

    def stderr_tail(self, n: int = 1500) -> str:
        """The last n characters of the child's stderr."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-n:]

    def kill9(self) -> None:
        """SIGKILL: the child gets no chance to resign or revoke its lease."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful leave), SIGKILL after timeout_s. Never raises."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        self._stderr.close()

    def __enter__(self) -> "ProbeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python tests/cluster_probe.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--backend", choices=("local", "etcd"), default="local")
    ap.add_argument("--state-dir", default="")
    ap.add_argument("--key-prefix", default="/mooncaked/")
    ap.add_argument("--etcd", action="append", help="etcd client URL (repeatable)")
    ap.add_argument("--ttl", type=float, default=5.0, help="lease TTL, seconds")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="keep-alive interval, seconds")
    ap.add_argument("--poll", type=float, default=0.2, help="local backend poll interval, s")
    ap.add_argument("--op-timeout", type=float, default=5.0, help="store call timeout, s")
    ap.add_argument("--campaign", action="store_true", help="campaign for the conductor")
    ap.add_argument("--watch-members", action="store_true", help="print membership events")
    ap.add_argument("--rpc-port", type=int, default=None, help="serve control RPC (0: any)")
    args = ap.parse_args(argv)
    try:
        import uvloop  # the daemon's loop: check the coordination stack on it too
        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
