"""Layer-wise KV push (cluster/kv_push.py) between two real transfer engines on loopback.

The engine side (LayerwiseKV filled by real prefill steps) is covered in test_engine.py;
here the stage is filled by the same copy_layer calls from a worker thread, as the
engine's step thread does, and pushed into a receive segment of a second engine.
"""

from __future__ import annotations

import asyncio

import torch

from mooncaked.cluster.kv_push import KVPusher
from mooncaked.config import TransferSettings
from mooncaked.engine.kv_stream import LayerwiseKV
from mooncaked.transfer import TransferEngine

LAYERS, BLOCK, HEADS, DIM = 4, 16, 2, 8


def engine(node: str) -> TransferEngine:
    return TransferEngine(TransferSettings(backend="tcp", request_timeout_s=10.0), node_id=node)


def pages(num_pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn((num_pages, LAYERS, 2, BLOCK, HEADS, DIM), generator=g)


def prefill_steps(kv: LayerwiseKV, cache: torch.Tensor, table: list[int], ends: list[int]) -> None:
    """What LLMEngine.step does for a prefilling request, one step per entry of ends."""
    for end in ends:
        kv.begin_step(table, end, torch.device("cpu"))
        for layer in range(LAYERS):
            kv.copy_layer(cache, layer)
        kv.end_step()


async def push(num_tokens: int, ends: list[int], reserve_fn=None, recv_blocks: int | None = None):
    """Runs a push end to end; returns (stats, stage, receive buffer, pages, table)."""
    a, b = engine("p"), engine("d")
    await a.start()
    await b.start()
    try:
        cache = pages(64)
        nblocks = -(-num_tokens // BLOCK)
        table = list(range(40, 40 - nblocks, -1))            # pages out of order
        kv = LayerwiseKV(LAYERS, nblocks, BLOCK, HEADS, DIM, torch.float32)
        recv = torch.zeros((LAYERS, recv_blocks or nblocks, 2, BLOCK, HEADS, DIM))

        async def reserve() -> dict:
            return {"descriptor": b.register_segment("d/recv/r1", recv)}

        pusher = KVPusher(a, kv, reserve_fn or reserve, timeout_s=10.0)
        kv.on_layer = pusher.on_layer
        pusher.start()
        await asyncio.to_thread(prefill_steps, kv, cache, table, ends)
        stats = await pusher.finish(asyncio.get_running_loop().time())
        await pusher.aclose()
        return stats, kv.stage, recv, cache, table
    finally:
        await a.close()
        await b.close()


def expected_stage(cache: torch.Tensor, table: list[int]) -> torch.Tensor:
    return cache[torch.tensor(table)].permute(1, 0, 2, 3, 4, 5)


def test_chunked_push_lands_byte_exact_with_the_partial_block_resent():
    # 3 steps: 40, 80 and 100 tokens; blocks 2 and 4 are partial after steps 1 and 2
    stats, stage, recv, cache, table = asyncio.run(push(100, [40, 80, 100]))
    assert stats.ok and stats.error is None
    assert torch.equal(stage, expected_stage(cache, table))
    assert torch.equal(recv, stage)
    layer_block = 2 * BLOCK * HEADS * DIM * 4
    # step ranges: blocks [0, 3), [2, 5), [5, 7) for every layer
    assert stats.bytes == LAYERS * (3 + 3 + 2) * layer_block
    assert 1 <= stats.writes <= 3 * LAYERS
    assert 0.0 <= stats.overlap <= 1.0 and stats.busy_s > 0 and stats.exposed_s >= 0


def test_failed_reservation_means_no_push_and_a_clear_reason():
    async def refuse() -> dict:
        raise ValueError("receive buffers full")

    stats, stage, recv, cache, table = asyncio.run(push(50, [50], reserve_fn=refuse))
    assert not stats.ok and stats.bytes == 0 and stats.writes == 0
    assert stats.error.startswith("reserve: ValueError: receive buffers full")
    assert torch.equal(stage, expected_stage(cache, table))   # still staged for a READ
    assert not recv.any()


def test_write_beyond_the_granted_segment_is_refused():
    # the decode node granted a buffer of 1 block for a 4-block prompt
    stats, _, recv, _, _ = asyncio.run(push(64, [64], recv_blocks=1))
    assert not stats.ok and "TransferError" in stats.error
