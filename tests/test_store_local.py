"""Local object API of the KV store: DRAM tier, leases, tiering to SSD, events."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mooncaked.config import StoreSettings
from mooncaked.store import DRAM, SSD, BlockPinned, LeaseExpired, PutStatus, block_keys, make_salt
from mooncaked.store.store import BlockStore

BLOCK = 4096


def run(coro, timeout=30):
    """Runs one test coroutine with a bound on its duration."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def blocks(n, seed=0, size=BLOCK):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def keys(n, tag=0):
    return block_keys(list(range(tag * 100000, tag * 100000 + 4 * n)), 4, make_salt("t", 4, "f32"))


def settings(dram_blocks, ssd_blocks=0, **kw):
    return StoreSettings(dram_bytes=dram_blocks * BLOCK, ssd_bytes=ssd_blocks * (BLOCK + 64), **kw)


def test_put_get_exact_exists_remove():
    async def main():
        ks, data = keys(5), blocks(5)
        async with BlockStore(BLOCK, settings(8)) as st:
            for k, d in zip(ks, data):
                r = await st.put(k, d)
                assert r.status is PutStatus.STORED and r.tier == DRAM
            again = await st.put(ks[0], data[1])  # immutable: no overwrite
            assert again.status is PutStatus.EXISTS and again.ok
            assert await st.get(ks[0]) == data[0].tobytes()
            # get_many into caller buffers of several kinds (bytearray, numpy, torch fp32)
            dsts = [bytearray(BLOCK), np.empty(BLOCK, np.uint8), torch.empty(BLOCK // 4)]
            assert await st.get_many(ks[:3], dsts) == [DRAM, DRAM, DRAM]
            assert bytes(dsts[0]) == data[0].tobytes()
            assert dsts[1].tobytes() == data[1].tobytes()
            assert dsts[2].numpy().tobytes() == data[2].tobytes()
            assert st.exists(ks[4]) and await st.remove(ks[4]) and not st.exists(ks[4])
            assert await st.get(ks[4]) is None
            assert not await st.remove(ks[4])
            assert st.metrics.misses == 1 and st.metrics.put_exists == 1
            with pytest.raises(ValueError):
                await st.put(ks[4], bytes(BLOCK - 1))
            with pytest.raises(ValueError):
                await st.get_into(ks[0], bytes(BLOCK))  # read-only destination
            with pytest.raises(ValueError):
                await st.put(b"", bytes(BLOCK))
    run(main())


def test_location_points_at_the_bytes():
    async def main():
        ks, data = keys(3), blocks(3)
        async with BlockStore(BLOCK, settings(4), node_id="n1") as st:
            await st.put_many(ks, data)
            locs, lease = await st.locate_many(ks + [b"x" * 16])
            assert locs[3] is None and lease.keys == tuple(ks)
            for loc, d in zip(locs[:3], data):
                assert loc.segment == "n1/kv-dram" and loc.length == BLOCK
                assert st.dram.buffer[loc.offset: loc.offset + loc.length].tobytes() == d.tobytes()
            st.release(lease)
            assert lease.state == "released" and not st.is_pinned(ks[0])
    run(main())


def test_eviction_never_takes_leased_blocks_without_ssd():
    async def main():
        ks, data = keys(6), blocks(6)
        async with BlockStore(BLOCK, settings(3)) as st:
            await st.put_many(ks[:3], data[:3])
            lease = st.lease(ks[:2], ttl_s=60)
            # One slot evictable: the 4th put evicts ks[2]; once ks[3] is leased too,
            # the 5th put finds only leased blocks.
            assert (await st.put(ks[3], data[3])).tier == DRAM
            assert not st.exists(ks[2])
            lease2 = st.lease(ks[3:4], ttl_s=60)
            r = await st.put(ks[4], data[4])
            assert r.status is PutStatus.FAILED
            assert r.reason == ("no room: DRAM pool full (3 slots: 0 hold this batch's blocks, "
                                "3 are pinned by readers) and no SSD tier")
            assert st.metrics.io_errors == 0
            for k, d in zip(ks[:2], data[:2]):
                assert await st.get(k) == d.tobytes()
            with pytest.raises(BlockPinned):
                await st.remove(ks[0])
            st.release(lease)
            st.release(lease2)
            assert (await st.put(ks[4], data[4])).status is PutStatus.STORED
            assert st.metrics.put_failed == 1 and st.metrics.evictions[DRAM] == 2
    run(main())


def test_lease_expiry_fails_loudly():
    async def main():
        ks, data = keys(2), blocks(2)
        async with BlockStore(BLOCK, settings(1)) as st:
            await st.put(ks[0], data[0])
            lease = st.lease(ks[:1], ttl_s=0.02)
            assert st.is_pinned(ks[0])
            while lease.state == "held":  # the expiry timer fires (bounded by run's timeout)
                await asyncio.sleep(0.005)
            assert lease.state == "expired" and not st.is_pinned(ks[0])
            # Its slot can now be reused by another block...
            assert (await st.put(ks[1], data[1])).tier == DRAM and not st.exists(ks[0])
            # ...so a reader that releases after the deadline is told to discard its bytes.
            with pytest.raises(LeaseExpired):
                st.release(lease)
            assert st.metrics.lease_expired == 1
    run(main())


def test_tiering_down_and_up_byte_exact(tmp_path):
    async def main():
        ks, data = keys(10), blocks(10, seed=1)
        async with BlockStore(BLOCK, settings(3, 20), ssd_dir=str(tmp_path)) as st:
            results = await st.put_many(ks, data)
            assert all(r.status is PutStatus.STORED for r in results)
            tiers = [st.tier_of(k) for k in ks]
            assert tiers.count(DRAM) == 3 and tiers.count(SSD) == 7
            # 3 fit; the batch evicts none of its own, so the other 7 go straight to SSD,
            # after the 3 were written through (head before tail).
            assert st.metrics.persisted == 3 and st.metrics.puts[SSD] == 7
            assert st.metrics.demotions == 0
            dst = np.empty(BLOCK, np.uint8)
            for k, d in zip(ks, data):  # every block, whatever its tier, byte-exact
                assert await st.get_into(k, dst) in (DRAM, SSD)
                assert dst.tobytes() == d.tobytes()
            # Reads from SSD promote (up on use), possibly in the background.
            for _ in range(200):
                if st.metrics.promotions >= 1 and not st.tiers.background:
                    break
                await asyncio.sleep(0.01)
            assert st.metrics.promotions >= 1
            assert st.longest_prefix(ks) == 10
            assert st.dram.used_bytes == 3 * BLOCK
            # load_prefix: the held prefix into caller buffers, stopping at the first miss.
            await st.remove(ks[6])
            bufs = [np.empty(BLOCK, np.uint8) for _ in ks]
            assert await st.load_prefix(ks, bufs) == 6
            assert all(b.tobytes() == d.tobytes() for b, d in zip(bufs[:6], data[:6]))
    run(main())


def test_prefix_tail_is_evicted_first():
    async def main():
        chain, other = keys(4, tag=1), keys(2, tag=2)
        data = blocks(6)
        async with BlockStore(BLOCK, settings(4)) as st:
            await st.put_many(chain, data[:4])
            # put_many touched the chain deepest-first, so the LRU victim is its tail.
            await st.put_many(other, data[4:])
            assert st.longest_prefix(chain) == 2
            assert [st.exists(k) for k in chain] == [True, True, False, False]
    run(main())


def test_concurrent_puts_of_one_key(tmp_path):
    async def main():
        ks, data = keys(3), blocks(3)
        async with BlockStore(BLOCK, settings(1, 10), ssd_dir=str(tmp_path)) as st:
            await st.put(ks[0], data[0])
            # DRAM is full: both puts of ks[1] take the slow path (demotion), only one stores.
            r1, r2 = await asyncio.gather(st.put(ks[1], data[1]), st.put(ks[1], data[1]))
            assert sorted([r1.status.value, r2.status.value]) == ["exists", "stored"]
            assert await st.get(ks[1]) == data[1].tobytes()
            assert await st.get(ks[0]) == data[0].tobytes()
    run(main())


def test_events_batched_in_order_and_inventory(tmp_path):
    async def main():
        ks, data = keys(4), blocks(4)
        s = settings(2, 10, event_interval_ms=20.0, event_max_keys=1000)
        async with BlockStore(BLOCK, s, node_id="n7", ssd_dir=str(tmp_path)) as st:
            q = st.subscribe()
            await st.put_many(ks, data)  # ks[0], ks[1] fit; written through, then the tail
            batch = await asyncio.wait_for(q.get(), 5)  # one delivery after ~20 ms
            flat = [(e.kind, e.tier, k) for e in batch for k in e.keys]
            assert flat == [("stored", DRAM, ks[0]), ("stored", DRAM, ks[1]),
                            ("stored", SSD, ks[0]), ("stored", SSD, ks[1]),
                            ("stored", SSD, ks[2]), ("stored", SSD, ks[3])]
            assert all(e.node_id == "n7" for e in batch)
            assert [e.seq for e in batch] == list(range(1, len(batch) + 1))
            inv = st.inventory()
            assert inv.seq == batch[-1].seq
            assert sorted(inv.tiers[DRAM]) == sorted(ks[:2])
            assert sorted(inv.tiers[SSD]) == sorted(ks)
            # max_keys triggers an immediate flush (no timer wait).
            st.events.max_keys = 2
            await st.remove(ks[0])
            batch = q.get_nowait()
            assert [(e.kind, e.tier, e.keys) for e in batch] == [("evicted", DRAM, (ks[0],)),
                                                                  ("evicted", SSD, (ks[0],))]
    run(main())


def test_put_fails_cleanly_without_any_capacity():
    async def main():
        async with BlockStore(BLOCK, StoreSettings(dram_bytes=0)) as st:
            r = await st.put(keys(1)[0], bytes(BLOCK))
            assert r.status is PutStatus.FAILED and r.reason and not r.ok
            assert st.metrics.put_failed == 1
    run(main())


@pytest.mark.parametrize("policy", ["lru", "sieve", "fifo"])
def test_policies_never_evict_pinned(policy):
    async def main():
        ks, data = keys(12), blocks(12)
        async with BlockStore(BLOCK, settings(4, eviction=policy)) as st:
            await st.put_many(ks[:4], data[:4])
            lease = st.lease([ks[0], ks[2]], ttl_s=60)
            for k, d in zip(ks[4:], data[4:]):
                assert (await st.put(k, d)).ok
                assert st.exists(ks[0]) and st.exists(ks[2])
            assert await st.get(ks[2]) == data[2].tobytes()
            st.release(lease)
    run(main())


def test_policy_orders():
    from mooncaked.store.policy import FIFO, LRU, SIEVE
    lru, fifo, sieve = LRU(), FIFO(), SIEVE()
    for p in (lru, fifo, sieve):
        for k in "abcd":
            p.insert(k)
        p.touch("a")
    assert lru.victim(lambda k: True) == "b"
    assert fifo.victim(lambda k: True) == "a"
    assert sieve.victim(lambda k: True) == "b"  # "a" was visited: its bit is cleared, kept
    assert lru.victim(lambda k: k not in "bc") == "d"
    sieve.remove("b")
    assert sieve.victim(lambda k: True) == "c" and len(sieve) == 3
    assert sieve.victim(lambda k: False) is None


def test_slot_index_books_free_indexed_and_evicted_slots():
    """The books both tiers keep: lowest free slot first, take = free slot or the
    victim's (dropped, can_evict respected), load keeps the first of duplicate keys."""
    from mooncaked.store.slots import SlotIndex
    idx = SlotIndex(3, "lru")
    assert [idx.alloc(), idx.alloc()] == [0, 1] and idx.used_slots == 2
    idx.insert(b"a", 0, tag=(2, 7))
    idx.insert(b"b", 1)
    idx.touch(b"a")
    assert idx.take(lambda k: True) == (2, None)  # a free slot first
    assert idx.take(lambda k: k != b"b") == (0, b"a")  # then the victim's, dropped
    assert b"a" not in idx and idx.tag_of(b"a") is None and idx.entry(b"b") == (1, None)
    assert idx.take(lambda k: False) is None
    idx.free(0)
    assert idx.free_slots == 1 and idx.alloc() == 0
    loaded = SlotIndex(4)
    assert loaded.load([(b"x", 2, "t"), (b"y", 0, None), (b"x", 3, "u")]) == [3]
    assert loaded.entry(b"x") == (2, "t") and loaded.free_slots == 2
    assert loaded.victim(lambda k: True) == b"x"  # loaded oldest first
    with pytest.raises(ValueError):
        loaded.load([])
    with pytest.raises(ValueError):
        SlotIndex(-1)


def test_random_concurrent_ops_never_return_wrong_bytes(tmp_path):
    """Random puts/gets/removes/leases, several at once, on a small DRAM + SSD store:
    every hit is byte-exact, leased blocks stay, and slot accounting stays consistent."""
    async def main():
        rng = np.random.default_rng(7)
        universe = keys(40, tag=3)
        content = {k: rng.integers(0, 256, BLOCK, dtype=np.uint8) for k in universe}
        s = settings(5, 12, promote_on_get=True)
        async with BlockStore(BLOCK, s, ssd_dir=str(tmp_path)) as st:
            leases = []

            async def op():
                k = universe[int(rng.integers(len(universe)))]
                r = rng.random()
                if r < 0.4:
                    n = int(rng.integers(1, 4))
                    ks = universe[universe.index(k):][:n]
                    res = await st.put_many(ks, [content[x] for x in ks])
                    failed = [x for x in res if x.status is PutStatus.FAILED]
                    assert all("pinned" in x.reason for x in failed)
                elif r < 0.8:
                    dst = np.empty(BLOCK, np.uint8)
                    if await st.get_into(k, dst) is not None:
                        assert dst.tobytes() == content[k].tobytes()
                elif r < 0.9:
                    try:
                        await st.remove(k)
                    except BlockPinned:
                        assert st.is_pinned(k) or k in st.writer  # read or being stored
                else:
                    leases.append(st.lease([k], ttl_s=60))

            for _ in range(60):
                await asyncio.gather(*(op() for _ in range(4)))
                for lease in leases:  # leased blocks are never evicted or removed
                    assert all(st.exists(k) for k in lease.keys)
                if len(leases) > 3:
                    st.release(leases.pop(0))
            while st.tiers.background or st.tiers.flushing:  # promotions, write-through
                await asyncio.sleep(0.01)
            # Slot accounting: every indexed slot distinct, counts match.
            dram_slots = [st.dram.slot_of(k) for k in st.dram.keys()]
            assert len(set(dram_slots)) == len(dram_slots)
            assert len(dram_slots) + st.dram.index.free_slots == st.dram.num_slots
            ssd_slots = [st.ssd.slot_of(k) for k in st.ssd.keys()]
            assert len(set(ssd_slots)) == len(ssd_slots)
            assert len(ssd_slots) + st.ssd.index.free_slots == st.ssd.num_slots
            for k in universe:  # and everything held reads back exactly
                got = await st.get(k)
                assert got is None or got == content[k].tobytes()
    run(main())
