"""A stand-alone store node: a BlockStore lending its DRAM (and SSD) to peers.

What the `cache` role runs (no model): the store, the transfer engine with
the DRAM pool registered, and a control server answering `store.*`. Used by
the multi-process tests and for manual checks::

    python -m mooncaked.store.node --node-id c1 --block-bytes 737280 \\
        --dram-bytes 268435456 [--ssd-dir DIR --ssd-bytes N] [--fill 8 --seed 1]

Prints one JSON line when ready: {"ready": true, "node", "control": "host:port",
"filled": [hex keys]}; runs until stdin reaches EOF or SIGTERM/SIGINT arrives.
`--fill N --seed S` stores N blocks with `fill_keys(N, S)` / `fill_blocks(...)`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import numpy as np
import orjson

from mooncaked.wire.rpc import ControlClient, ControlServer
from mooncaked.config import StoreSettings, TransferSettings
from mooncaked.log import setup_logging
from mooncaked.transfer import TransferEngine

from .keys import block_keys, make_salt
from .remote import StoreNode
from .store import BlockStore


def fill_keys(n: int, seed: int) -> list[bytes]:
    """n deterministic block keys (a chain) for test data."""
    return block_keys(list(range(seed * 1_000_000, seed * 1_000_000 + 16 * n)), 16,
                      make_salt("fill", 16, "uint8"))


def fill_blocks(n: int, seed: int, block_bytes: int) -> list[np.ndarray]:
    """n deterministic pseudo-random blocks ([block_bytes] uint8 each) for test data."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]


class RunningNode:
    """A started store + transfer engine + control server (+ client). `await close()`."""

    def __init__(self, store: BlockStore, engine: TransferEngine, server: ControlServer,
                 client: ControlClient, node: StoreNode):
        self.store, self.engine, self.server, self.client, self.node = (store, engine, server,
                                                                         client, node)

    @property
    def address(self) -> str:
        """Control address "host:port" of this node."""
        return self.node.address

    async def close(self) -> None:
        """Stops the control server, withdraws the segment, closes engine and store."""
        await self.server.stop()
        await self.client.close()
        self.node.close()
        await self.engine.close()
        await self.store.close()


async def start_node(node_id: str, block_bytes: int, store_settings: StoreSettings,
                     ssd_dir: str | None = None, host: str = "127.0.0.1",
                     transfer: TransferSettings | None = None,
                     control_port: int = 0) -> RunningNode:
    """Starts a store node; the control server on `host`, port `control_port` (0: chosen by
    the OS), and the transfer engine from `transfer` (default: TCP on `host`, OS-chosen port).
    Raises: OSError if a port cannot be bound; what BlockStore/TransferEngine raise."""
    store = await BlockStore(block_bytes, store_settings, node_id=node_id, ssd_dir=ssd_dir).start()
    engine = TransferEngine(transfer or TransferSettings(host=host, port=0, backend="tcp"),
                            node_id=node_id)
    await engine.start()
    server = ControlServer()
    client = ControlClient(timeout_s=10.0)
    node = StoreNode(store, engine, client)
    node.start()
    node.add_handlers(server)
    h, p = await server.start(host, control_port)
    node.address = f"{h}:{p}"
    return RunningNode(store, engine, server, client, node)


async def _main(args: argparse.Namespace) -> None:
    s = StoreSettings(dram_bytes=args.dram_bytes, ssd_bytes=args.ssd_bytes)
    running = await start_node(args.node_id, args.block_bytes, s, args.ssd_dir or None)
    try:
        filled: list[bytes] = []
        if args.fill:
            filled = fill_keys(args.fill, args.seed)
            results = await running.store.put_many(
                filled, fill_blocks(args.fill, args.seed, args.block_bytes))
            if not all(r.ok for r in results):
                raise SystemExit(f"fill failed: {results}")
        print(orjson.dumps({"ready": True, "node": args.node_id, "control": running.address,
                            "filled": [k.hex() for k in filled]}).decode(), flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        eof = loop.run_in_executor(None, sys.stdin.read)
        await asyncio.wait([eof, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        await running.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m mooncaked.store.node`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--dram-bytes", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--ssd-dir", default="")
    ap.add_argument("--ssd-bytes", type=int, default=0)
    ap.add_argument("--fill", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
