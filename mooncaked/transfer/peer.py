"""A stand-alone transfer-engine peer: one process, its segments, driven by JSON lines on stdin.

Used by the multi-process tests and the benchmark, and handy for manual checks
(e.g. two hosts with soft-RoCE, see docs/transfer.md)::

    python -m mooncaked.transfer.peer --node-id b --segment b/dram=67108864 --fill-seed 1

It prints one JSON line when ready: {"ready": true, "node", "port", "backend",
"rdma_unavailable_reason", "descriptors": {name: descriptor}} (or {"ready": false,
"error"} and exits with status 2 when the engine cannot start); then answers one JSON
line per command line (stdin EOF or {"cmd": "quit"} ends it):

- {"cmd": "add_peer", "descriptor": {...}}
- {"cmd": "transfer", "op": "read"|"write", "local": segment, "local_offset": n,
  "segment": name, "remote_offset": n, "length": n}  -> {"state", "reason"}
- {"cmd": "sha256", "segment": name, "offset": n, "length": n}  -> {"sha256"}
- {"cmd": "fill", "segment": name, "seed": n}  (deterministic pseudo-random bytes)
- {"cmd": "unregister", "segment": name}; {"cmd": "stats"}; {"cmd": "quit"}

Every answer has "ok" (false with "error" on a bad command).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import orjson

from mooncaked.config import TransferSettings
from mooncaked.log import setup_logging

from .batch import TransferOp, TransferRequest
from .engine import TransferEngine
from .rdma_nic import RdmaUnavailable


def fill_bytes(view: memoryview, seed: int) -> None:
    """Deterministic pseudo-random bytes (same seed, same bytes) written into `view`."""
    arr = np.frombuffer(view, dtype=np.uint8)
    arr[:] = np.random.default_rng(seed).integers(0, 256, size=arr.size, dtype=np.uint8)


def _emit(obj: dict) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


async def _command(engine: TransferEngine, buffers: dict[str, np.ndarray], msg: dict) -> dict:
    cmd = msg.get("cmd")
    if cmd == "add_peer":
        return {"name": engine.add_peer_segment(msg["descriptor"])}
    if cmd == "transfer":
        req = TransferRequest(TransferOp(msg["op"]), msg["segment"], int(msg["remote_offset"]),
                              msg["local"], int(msg.get("local_offset", 0)),
                              int(msg["length"]))
        status = (await engine.transfer([req], check=False))[0]
        return {"state": status.state.value, "reason": status.reason}
    if cmd == "sha256":
        view = memoryview(buffers[msg["segment"]]).cast("B")
        off = int(msg.get("offset", 0))
        end = off + int(msg.get("length", view.nbytes - off))
        return {"sha256": hashlib.sha256(view[off:end]).hexdigest()}
    if cmd == "fill":
        fill_bytes(memoryview(buffers[msg["segment"]]).cast("B"), int(msg["seed"]))
        return {}
    if cmd == "unregister":
        engine.unregister_segment(msg["segment"])
        return {}
    if cmd == "stats":
        return {"stats": engine.stats()}
    raise ValueError(f"unknown command {cmd!r}")


async def serve(args: argparse.Namespace) -> None:
    """Runs the peer until stdin closes or a quit command arrives."""
    settings = TransferSettings(host=args.host, port=args.port, backend=args.backend,
                                require_rdma=args.require_rdma,
                                connections_per_peer=args.connections,
                                slice_size_bytes=args.slice_bytes,
                                request_timeout_s=args.timeout)
    engine = TransferEngine(settings, node_id=args.node_id)
    try:
        await engine.start()
    except (RdmaUnavailable, OSError, ValueError) as e:
        _emit({"ready": False, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(2) from None
    buffers: dict[str, np.ndarray] = {}
    descriptors = {}
    for spec in args.segment:
        name, _, size = spec.partition("=")
        buf = np.zeros(int(size), dtype=np.uint8)
        if args.fill_seed is not None:
            fill_bytes(memoryview(buf), args.fill_seed)
        buffers[name] = buf
        descriptors[name] = engine.register_segment(name, buf)
    _emit({"ready": True, "node": engine.node_id, "port": engine.port, "backend": engine.backend,
           "rdma_unavailable_reason": engine.rdma_unavailable_reason,
           "descriptors": descriptors})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            try:
                msg = orjson.loads(line)
                if msg.get("cmd") == "quit":
                    _emit({"ok": True})
                    break
                _emit({"ok": True, **await _command(engine, buffers, msg)})
            except Exception as e:  # noqa: BLE001 - answer the driver, keep serving
                _emit({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        await engine.close()


class PeerProcess:
    """Drives a peer process from tests and benchmarks: spawn, command, stop (all bounded).

    Args: node_id; segments {name: bytes}; extra command-line flags; `timeout_s` bounds
    every wait (start, each command). Attributes after construction: `info` (the ready
    line), `descriptors`, `port`, `proc`. Raises: TimeoutError, RuntimeError when the
    process exits or answers with an error.
    """

    def __init__(self, node_id: str, segments: dict[str, int], *args: str,
                 timeout_s: float = 20.0, stderr=None):
        cmd = [sys.executable, "-m", "mooncaked.transfer.peer", "--node-id", node_id]
        for name, size in segments.items():
            cmd += ["--segment", f"{name}={size}"]
        self.timeout = timeout_s
        self.proc = subprocess.Popen([*cmd, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.info = self._next_line()
            if not self.info.get("ready"):
                raise RuntimeError(f"peer {node_id} did not start: {self.info.get('error')}")
        except BaseException:
            self.kill()
            raise
        self.descriptors: dict[str, dict] = self.info["descriptors"]
        self.port: int = self.info["port"]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next_line(self) -> dict:
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"peer gave no answer within {self.timeout} s") from None
        if line is None:
            try:
                code = self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"peer exited (code {code})")
        return orjson.loads(line)

    def cmd(self, **msg) -> dict:
        """Sends one command and returns its answer. Raises RuntimeError on {"ok": false}."""
        self.proc.stdin.write(orjson.dumps(msg).decode() + "\n")
        self.proc.stdin.flush()
        answer = self._next_line()
        if not answer.get("ok"):
            raise RuntimeError(f"peer command {msg.get('cmd')} failed: {answer.get('error')}")
        return answer

    async def acmd(self, **msg) -> dict:
        """`cmd` from async code (in a thread, so this loop keeps serving the peer)."""
        return await asyncio.to_thread(self.cmd, **msg)

    def signal(self, sig: int) -> None:
        """Sends `sig` unless the process has already exited. SIGSTOP and SIGCONT return
        once every thread of the process is stopped / running again (signals are delivered
        asynchronously; a request could otherwise still be served after SIGSTOP)."""
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            return
        want_stopped = sig == signal.SIGSTOP
        deadline = time.monotonic() + self.timeout
        while self._all_stopped() != want_stopped:
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer did not {'stop' if want_stopped else 'resume'}")
            time.sleep(0.001)

    def _all_stopped(self) -> bool:
        states = []
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # the thread just exited
                continue
        return all(s in ("T", "t") for s in states)

    def kill(self) -> None:
        """SIGKILL and reap (idempotent)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=self.timeout)

    def stop(self) -> None:
        """Asks the peer to quit, killing it if it does not within the timeout."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=self.timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m mooncaked.transfer.peer`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-id", required=True)
    p.add_argument("--segment", action="append", default=[], help="NAME=BYTES (repeatable)")
    p.add_argument("--fill-seed", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--backend", default="auto", choices=("auto", "tcp", "rdma"))
    p.add_argument("--require-rdma", action="store_true", help="refuse to start without RDMA")
    p.add_argument("--connections", type=int, default=TransferSettings.connections_per_peer)
    p.add_argument("--slice-bytes", type=int, default=TransferSettings.slice_size_bytes)
    p.add_argument("--timeout", type=float, default=TransferSettings.request_timeout_s)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    setup_logging(args.log_level, "json")
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
