"""Prefix reuse of CPP stages beyond their pages (cluster/cpp/stage_prefix.py), with two real
stage processes, each running its own KV store (`--store-bytes`), on loopback:

- a stage's slices of a finished request's full blocks go into its store, so after the
  pages were reused by another request the same prompt still starts after its cached
  prefix, loaded from the store;
- a stage takes the full blocks another node's store holds by a ranged READ of only its
  layers' bytes (StoreNode.get_ranges): bytes read = its share of the blocks;
and the greedy token is the full model's either way."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from mooncaked.benchmarks.stage_process import start_stage_process
from mooncaked.wire.rpc import ControlClient
from mooncaked.config import StoreSettings
from mooncaked.engine.stage import StageEngine, prefill_through, split_layers
from mooncaked.model.weights import bundled_model_path
from mooncaked.store.keys import block_keys, make_salt, slice_key
from mooncaked.store.node import start_node

WAIT_S = 30.0                # bound on every wait for a state change
R0, R1 = split_layers(30, 2)
BS = 16
STAGE_PAGES = 24             # pages per stage: two prompts of 200 and 300 tokens do not fit


async def _call(addr, method, body=None, timeout_s=120.0):
    async with ControlClient(timeout_s=timeout_s) as c:
        return await c.call(addr, method, body)


def _status(addr: str) -> dict:
    return asyncio.run(_call(addr, "cpp.status"))


def _wait(pred, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)   # poll interval
    return v


@pytest.fixture(scope="module")
def full():
    """The whole model in this process: the reference token and full KV blocks, in the
    stages' numerics (auto: on AVX2 int8 prompt projections, which can pick another token
    than float32's from the near-tie logits of a random-token prompt)."""
    return StageEngine(bundled_model_path(), range(30), dtype="auto", kv_cache_bytes=32 << 20,
                       num_threads=1)


@pytest.fixture(scope="module")
def group(full):
    page = full.block_bytes // 2                # a stage page: 15 of 30 layers
    extra = ("--store-bytes", str(32 << 20), "--kv-cache-bytes", str(STAGE_PAGES * page))
    p1, a1 = start_stage_process(R1, "", max_tokens=1024, idle_timeout_s=10.0, extra=extra)
    p0, a0 = start_stage_process(R0, a1, max_tokens=1024, idle_timeout_s=10.0, extra=extra)
    yield a0, a1
    for p in (p0, p1):
        p.kill()
        p.wait(10)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (n,), generator=g).tolist()


def _keys(prompt: list[int], tenant: str) -> list[bytes]:
    return block_keys(prompt, BS, make_salt("stage-prefix-test", BS, "float32", tenant))


def _want(full: StageEngine, rid: str, prompt: list[int]) -> int:
    token = int(torch.argmax(prefill_through([full], rid, prompt, chunk_tokens=512)))
    return token


def test_slices_in_the_stage_store_outlive_the_pages(group, full):
    a0, a1 = group
    pa, pb = _prompt(1, 200), _prompt(2, 300)          # 12 and 18 full blocks
    ka, kb = _keys(pa, "a"), _keys(pb, "a")
    want_a = _want(full, "ref-a", pa)
    full.release("ref-a")

    def prefill(rid, prompt, keys):
        return asyncio.run(_call(a0, "cpp.prefill", {"request_id": rid, "token_ids": prompt,
                                                      "chunk_tokens": 64,
                                                      "keys": [k.hex() for k in keys]}))
    r = prefill("a1", pa, ka)
    assert (r["token_id"], r["cached_tokens"]) == (want_a, 0)
    # 18 + 1 pages for B, at once: while A's pages are copied into the store B's chunks
    # wait for them; then A's cached pages are reused, tail first (the engine's BlockManager
    # order: a prefix's head is what later requests share), so A's tail no longer matches
    r = prefill("b1", pb, kb)
    assert r["cached_tokens"] == 0
    # each stage puts the 12 + 18 slices into its store as it releases the requests
    for addr in group:
        _wait(lambda addr=addr: _status(addr)["prefix"]["offloaded_blocks"] >= 30,
              f"{addr} to store its slices")
    before = [_status(a)["prefix"] for a in group]
    r = prefill("a2", pa, ka)
    after = [_status(a)["prefix"] for a in group]
    assert r["token_id"] == want_a
    assert r["cached_tokens"] == 12 * BS                        # (200 - 1) // 16 blocks
    for b, a in zip(before, after):
        from_pages = a["page_blocks"] - b["page_blocks"]        # A's head, still cached
        from_store = a["store_blocks"] - b["store_blocks"]      # its evicted tail
        assert from_pages + from_store == 12
        assert 0 < from_pages < 12 and from_store > 0
        assert a["fetched_blocks"] == b["fetched_blocks"]


def test_a_stage_reads_only_its_layers_of_full_blocks_held_elsewhere(group, full):
    a0, a1 = group
    pc = _prompt(3, 150)                                    # 9 full blocks
    kc = _keys(pc, "c")
    want_c = _want(full, "ref-c", pc)
    kv = full.read_kv("ref-c")                               # [10, 30, 2, 16, kv_heads, head_dim]
    full.release("ref-c")
    blocks = [kv[i].contiguous() for i in range(len(kc))]   # full blocks, the store's layout

    async def run():
        holder = await start_node("holder", full.block_bytes,
                                  StoreSettings(dram_bytes=16 * full.block_bytes))
        try:
            assert all(x.ok for x in await holder.store.put_many(kc, blocks))
            before = [(await _call(a, "cpp.status"))["prefix"] for a in group]
            r = await _call(a0, "cpp.prefill", {
                "request_id": "c1", "token_ids": pc, "chunk_tokens": 64,
                "keys": [k.hex() for k in kc],
                "fetch": {"control": holder.address, "blocks": len(kc)}})
            after = [(await _call(a, "cpp.status"))["prefix"] for a in group]
            served = holder.store.metrics.served
            pinned = [holder.store.is_pinned(k) for k in kc]
            return r, before, after, served, pinned
        finally:
            await holder.close()

    r, before, after, served, pinned = asyncio.run(run())
    assert r["token_id"] == want_c
    assert r["cached_tokens"] == 9 * BS
    share = full.block_bytes // 2                            # 15 of 30 layers
    for b, a in zip(before, after):
        assert a["fetched_blocks"] - b["fetched_blocks"] == 9
        assert a["fetched_bytes"] - b["fetched_bytes"] == 9 * share
        assert a["store_blocks"] == b["store_blocks"]
    assert served == 2 * 9 and not any(pinned)               # each stage's READs, leases released
    # the fetched slices went into each stage's own store under the slice key
    for addr, layers in ((a0, R0), (a1, R1)):
        keys = [slice_key(k, layers.start, layers.stop).hex() for k in kc]
        _wait(lambda addr=addr, keys=keys: asyncio.run(_call(addr, "store.query", {"keys": keys}))
              ["prefix"] == 9, f"{addr} to store the fetched slices")
