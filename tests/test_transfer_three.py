"""Three processes on loopback: this one and two peers moving bytes among all three, with an
endpoint pool small enough that SIEVE must evict."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from mooncaked.config import TransferSettings
from mooncaked.transfer import TransferEngine, TransferOp, TransferRequest
from mooncaked.transfer.peer import PeerProcess, fill_bytes

MiB = 1 << 20


@pytest.fixture
def two_peers():
    started = []
    try:
        for node, seed in (("b", 21), ("c", 22)):
            started.append(PeerProcess(node, {f"{node}/dram": 4 * MiB}, "--backend", "tcp",
                                       "--fill-seed", str(seed), "--connections", "2"))
        yield started
    finally:
        for p in started:
            p.signal(signal.SIGCONT)
            p.stop()


def seeded(n: int, seed: int) -> bytes:
    buf = bytearray(n)
    fill_bytes(memoryview(buf), seed)
    return bytes(buf)


def test_three_processes_move_bytes_among_each_other(two_peers):
    b, c = two_peers
    rng = random.Random(5)
    x, y = rng.randbytes(MiB), rng.randbytes(MiB)
    b.cmd(cmd="add_peer", descriptor=c.descriptors["c/dram"])
    c.cmd(cmd="add_peer", descriptor=b.descriptors["b/dram"])

    async def main():
        settings = TransferSettings(backend="tcp", connections_per_peer=2, max_endpoints=3,
                                    slice_size_bytes=128 * 1024, request_timeout_s=20.0)
        async with TransferEngine(settings, node_id="a") as a:
            a.add_peer_segment(b.descriptors["b/dram"])
            a.add_peer_segment(c.descriptors["c/dram"])
            # a -> b and a -> c in one batch.
            await a.transfer([TransferRequest(TransferOp.WRITE, "b/dram", 0, x),
                              TransferRequest(TransferOp.WRITE, "c/dram", MiB, y)])
            # b pulls from c while c pushes to b, at the same time as a reads from both.
            from_c, from_b = bytearray(MiB), bytearray(MiB)
            answers = await asyncio.gather(
                b.acmd(cmd="transfer", op="read", local="b/dram", local_offset=2 * MiB,
                       segment="c/dram", remote_offset=MiB, length=MiB),
                c.acmd(cmd="transfer", op="write", local="c/dram", local_offset=3 * MiB,
                       segment="b/dram", remote_offset=3 * MiB, length=MiB // 2),
                a.read("c/dram", 0, from_c),
                a.read("b/dram", MiB, from_b))
            assert answers[0]["state"] == "done" and answers[1]["state"] == "done", answers
            assert from_c == seeded(4 * MiB, 22)[:MiB]
            assert from_b == seeded(4 * MiB, 21)[MiB:2 * MiB]
            got = {k: bytearray(n) for k, n in (("x", MiB), ("y_on_b", MiB), ("c_on_b", MiB // 2),
                                                ("y_on_c", MiB))}
            await a.transfer([
                TransferRequest(TransferOp.READ, "b/dram", 0, got["x"]),
                TransferRequest(TransferOp.READ, "b/dram", 2 * MiB, got["y_on_b"]),
                TransferRequest(TransferOp.READ, "b/dram", 3 * MiB, got["c_on_b"]),
                TransferRequest(TransferOp.READ, "c/dram", MiB, got["y_on_c"])])
            assert got["x"] == x
            assert got["y_on_c"] == y
            assert got["y_on_b"] == y  # c -> b, pulled by b
            assert got["c_on_b"] == seeded(4 * MiB, 22)[3 * MiB:3 * MiB + MiB // 2]
            stats = a.stats()
            assert stats["endpoints_evicted"] > 0  # 2 peers x (2 + 2) paths > 3 endpoints
            assert stats["endpoints"] <= 3  # over the cap only while all were busy
            assert stats["slices_retried"] == 0

    asyncio.run(asyncio.wait_for(main(), 60))
