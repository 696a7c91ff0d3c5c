"""Bare CPP stages, one per process, for `mooncake bench cpp` and the CPP tests (outside
the product: in a cluster a stage runs inside a prefill node, cluster/cpp/cpp_node.py).

    python -m mooncaked.benchmarks.stage_process --layers 15:30 [--next HOST:PORT]

serves one stage (a StageServer over a StageEngine of those layers) until killed, and
prints one JSON line {"control": "host:port", "weight_bytes": n} on stdout when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import select
import subprocess
import sys
import tempfile

import orjson

from mooncaked.cluster.cpp.pipeline_stage import StageServer
from mooncaked.cluster.cpp.stage_prefix import StagePrefix
from mooncaked.config import StoreSettings
from mooncaked.engine.stage import StageEngine
from mooncaked.model.weights import resolve_model_path
from mooncaked.store.remote import StoreNode
from mooncaked.store.store import BlockStore


def start_stage_process(layers: range, next_addr: str = "", *, max_tokens: int = 8192,
                        threads: int = 1, idle_timeout_s: float = 5.0, name: str = "",
                        ready_timeout_s: float = 300.0, extra: tuple[str, ...] = ()
                        ) -> tuple[subprocess.Popen, str]:
    """Starts `python -m mooncaked.benchmarks.stage_process` for `layers` (`extra`: more
    arguments, e.g. ("--store-bytes", "33554432")); returns the process and its control
    address once it printed its ready line. Start the last stage first: each stage needs
    its next stage's address.

    Raises: RuntimeError (with its stderr's tail) when it exits or says nothing within
        ready_timeout_s seconds (the process is killed then).
    """
    cmd = [sys.executable, "-m", "mooncaked.benchmarks.stage_process", "--layers",
           f"{layers.start}:{layers.stop}", "--threads", str(threads), "--max-tokens", str(max_tokens),
           "--idle-timeout-s", str(idle_timeout_s)]
    cmd += ["--next", next_addr] if next_addr else []
    cmd += ["--name", name] if name else []
    cmd += list(extra)
    err = tempfile.TemporaryFile()  # noqa: SIM115 - the stage writes to it while it lives
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        proc.wait(10)
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"stage {layers} did not start (exit code {proc.returncode}): {tail}")
    return proc, orjson.loads(line)["control"]


async def _serve(args: argparse.Namespace) -> None:
    a, b = (int(x) for x in args.layers.split(":"))
    stage = StageEngine(resolve_model_path(args.model), range(a, b), dtype=args.dtype,
                        kv_cache_bytes=args.kv_cache_bytes, max_positions=args.max_tokens,
                        num_threads=args.threads)
    server = StageServer(stage, args.name or f"stage-{a}-{b}", args.next or None,
                         max_tokens=args.max_tokens, idle_timeout_s=args.idle_timeout_s)
    addr = await server.start()
    store = await _start_store(server, args.store_bytes) if args.store_bytes else None
    sys.stdout.write(orjson.dumps({"control": addr, "weight_bytes": stage.weight_bytes}).decode() + "\n")
    sys.stdout.flush()
    try:
        await asyncio.Event().wait()  # until SIGTERM / SIGKILL
    finally:
        await server.stop()
        if store is not None:
            await store.close()


async def _start_store(server: StageServer, dram_bytes: int):
    """A stand-alone stage's own KV store of `dram_bytes` (its layer slices, lent to peers
    as store.* on its control server) and its StagePrefix. Returns the BlockStore."""

    st = server.stage
    store = await BlockStore(st.block_bytes, StoreSettings(dram_bytes=dram_bytes),
                             node_id=server.name).start()
    node = StoreNode(store, server.transfer, server.client, server.address)
    node.start()
    node.add_handlers(server.control)
    server.prefix = StagePrefix(st, st.cfg.num_layers, node)
    return store


def main(argv: list[str] | None = None) -> None:
    """`python -m mooncaked.benchmarks.stage_process`: serve one stage until killed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", required=True, help="this stage's layers, START:STOP")
    p.add_argument("--next", default="", help="the next stage's control address (none: last stage)")
    p.add_argument("--name", default="")
    p.add_argument("--model", default="", help="model path (default: the bundled model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024)
    p.add_argument("--idle-timeout-s", type=float, default=5.0)
    p.add_argument("--store-bytes", type=int, default=0,
                   help="DRAM of the stage's own KV store (its layer slices; 0: none)")
    args = p.parse_args(argv)
    try:
        import uvloop
        uvloop.run(_serve(args))
    except KeyboardInterrupt:
        pass


__all__ = ["main", "start_stage_process"]


if __name__ == "__main__":
    main()
