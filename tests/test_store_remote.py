"""The store across nodes: reads, fetch (replicas), put to a peer, copy, move, leases;
in one process (two nodes) and across processes (a real store node process)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from mooncaked.wire.errors import PeerUnavailable
from mooncaked.config import StoreSettings
from mooncaked.store import DRAM, PutStatus
from mooncaked.store.node import fill_blocks, fill_keys, start_node

BLOCK = 64 * 1024


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def dram(n_blocks, **kw):
    return StoreSettings(dram_bytes=n_blocks * BLOCK, **kw)


def test_two_nodes_put_get_fetch_copy_move():
    async def main():
        a = await start_node("a", BLOCK, dram(16))
        b = await start_node("b", BLOCK, dram(16))
        try:
            ks, data = fill_keys(6, 1), fill_blocks(6, 1, BLOCK)
            # put against another node's pool: b stores on a.
            res = await b.node.put_many(a.address, ks, data)
            assert [r.status for r in res] == [PutStatus.STORED] * 6
            assert all(a.store.tier_of(k) == DRAM for k in ks)
            assert await b.store.remove_many(ks) == [True] * 6
            tiers, prefix = await b.node.query(a.address, ks + [b"z" * 16])
            assert tiers == [DRAM] * 6 + [None] and prefix == 6
            # get from a's pool into caller buffers, byte-exact.
            dsts = [np.zeros(BLOCK, np.uint8) for _ in ks]
            assert await b.node.get_many(a.address, ks + [b"z" * 16],
                                         dsts + [np.zeros(BLOCK, np.uint8)]) == [True] * 6 + [False]
            assert all(d.tobytes() == x.tobytes() for d, x in zip(dsts, data))
            assert not any(a.store.is_pinned(k) for k in ks)  # leases released
            # fetch: a replica on b (same key on both nodes).
            res = await b.node.fetch(a.address, ks[:3])
            assert [r.status for r in res] == [PutStatus.STORED] * 3
            assert all([await b.store.get(k) == x.tobytes() for k, x in zip(ks[:3], data)])
            assert all(a.store.exists(k) for k in ks[:3])
            res = await b.node.fetch(a.address, ks[:1])
            assert res[0].status is PutStatus.EXISTS
            # move a -> b (driven by b here; the conductor would drive it the same way).
            res = await b.node.move(a.address, b.address, ks[3:])
            assert all(r.ok for r in res)
            assert not any(a.store.exists(k) for k in ks[3:])
            assert all([await b.store.get(k) == x.tobytes() for k, x in zip(ks[3:], data[3:])])
            # copy between two other nodes' pools (b -> a), asked by a third party (here b).
            res = await b.node.copy(b.address, a.address, ks[3:5])
            assert [r.status for r in res] == [PutStatus.STORED] * 2
            assert a.store.exists(ks[3]) and b.store.exists(ks[3])
        finally:
            await a.close()
            await b.close()
    run(main())


def test_peer_restarted_at_the_same_address_is_described_again():
    """A holder that restarts at the same control address keeps its segment name but gets a
    new transfer engine (data port, access key): the reader that learnt the old descriptor
    sees the new instance in the locate answer and describes the holder again, so reads and
    fetches (the conductor's hot-block replication onto a cache node) still succeed."""
    async def main():
        a = await start_node("a", BLOCK, dram(8))
        b = await start_node("b", BLOCK, dram(8))
        a2 = None
        try:
            ks, data = fill_keys(4, 5), fill_blocks(4, 5, BLOCK)
            await a.store.put_many(ks[:2], data[:2])
            res = await b.node.fetch(a.address, ks[:1])          # b learns a's descriptor
            assert [r.status for r in res] == [PutStatus.STORED]
            port, old_instance = int(a.address.rsplit(":", 1)[1]), a.engine.instance
            addr = a.address
            await a.close()
            a = None
            a2 = await start_node("a", BLOCK, dram(8), control_port=port)
            assert a2.address == addr and a2.engine.instance != old_instance
            await a2.store.put_many(ks[2:], data[2:])
            res = await b.node.fetch(a2.address, ks[2:3])
            assert [r.status for r in res] == [PutStatus.STORED], res
            assert await b.store.get(ks[2]) == data[2].tobytes()
            dst = np.zeros(BLOCK, np.uint8)
            assert await b.node.get_many(a2.address, ks[3:], [dst]) == [True]
            assert dst.tobytes() == data[3].tobytes()
            assert not any(a2.store.is_pinned(k) for k in ks[2:])   # leases released
        finally:
            for n in (a, a2, b):
                if n is not None:
                    await n.close()
    run(main())


def test_remote_read_after_lease_expiry_is_discarded(tmp_path):
    async def main():
        a = await start_node("a", BLOCK, dram(4))
        b = await start_node("b", BLOCK, dram(4))
        try:
            ks, data = fill_keys(2, 2), fill_blocks(2, 2, BLOCK)
            await a.store.put_many(ks, data)
            dsts = [np.zeros(BLOCK, np.uint8) for _ in ks]
            # A 1 us lease has certainly expired by the time the release reaches a.
            assert await b.node.get_many(a.address, ks, dsts, ttl_s=1e-6) == [False, False]
            assert b.node.remote_reads_discarded == 2
            res = await b.node.fetch(a.address, ks, ttl_s=1e-6)
            assert all(r.status is PutStatus.FAILED and "lease" in r.reason for r in res)
            assert not any(b.store.exists(k) for k in ks)  # nothing stored from a stale read
            assert b.store.dram.used_bytes == 0  # reserved slots were given back
        finally:
            await a.close()
            await b.close()
    run(main())


def test_ranged_read_takes_only_the_granted_bytes_of_leased_blocks():
    """get_ranges (a CPP stage's layers of full blocks): bytes [start, stop) of each block,
    byte-exact, into buffers of that size; a range outside the block is refused by the
    holder; a key it does not hold gets no lease and is not read; a read whose lease
    expired is discarded; the holder pins nothing afterwards."""
    from mooncaked.wire.errors import RpcError

    async def main():
        a = await start_node("a", BLOCK, dram(8))
        b = await start_node("b", 1024, StoreSettings(dram_bytes=64 * 1024))   # other block size
        try:
            ks, data = fill_keys(3, 3), fill_blocks(3, 3, BLOCK)
            await a.store.put_many(ks, data)
            lo, hi = BLOCK // 4, BLOCK // 2
            dsts = [np.zeros(hi - lo, np.uint8) for _ in range(4)]
            got = await b.node.get_ranges(a.address, ks + [b"z" * 16], lo, hi, dsts)
            assert got == [True, True, True, False]
            assert all(d.tobytes() == x[lo:hi].tobytes() for d, x in zip(dsts, data))
            assert not dsts[3].any()                        # not held: nothing read
            assert a.store.metrics.served == 3
            assert not any(a.store.is_pinned(k) for k in ks)
            for bad in ((BLOCK // 2, BLOCK + 16), (-16, 16), (64, 64)):
                with pytest.raises((RpcError, ValueError), match="range"):
                    n = max(bad[1] - bad[0], 1)
                    await b.node.get_ranges(a.address, ks[:1], *bad, [np.zeros(n, np.uint8)])
            # the holder itself refuses a range beyond its blocks (whatever the reader asks)
            with pytest.raises(RpcError, match="within a block"):
                await b.node.control.call(a.address, "store.locate",
                                          {"keys": [ks[0].hex()], "range": [0, BLOCK + 1]})
            with pytest.raises(ValueError, match="buffers of that size"):
                await b.node.get_ranges(a.address, ks[:1], lo, hi, [np.zeros(hi - lo + 1, np.uint8)])
            # an expired lease: the bytes are discarded
            assert await b.node.get_ranges(a.address, ks[:2], lo, hi, dsts[:2], ttl_s=1e-6) \
                == [False, False]
            assert b.node.remote_reads_discarded == 2
            # a whole-block read between nodes of different block sizes is still refused
            with pytest.raises(ValueError, match="blocks of"):
                await b.node.get_many(a.address, ks[:1], [np.zeros(1024, np.uint8)])
        finally:
            await a.close()
            await b.close()
    run(main())


def test_remote_get_promotes_ssd_blocks(tmp_path):
    async def main():
        s = StoreSettings(dram_bytes=2 * BLOCK, ssd_bytes=16 * BLOCK)
        a = await start_node("a", BLOCK, s, ssd_dir=str(tmp_path))
        b = await start_node("b", BLOCK, dram(8))
        try:
            ks, data = fill_keys(6, 3), fill_blocks(6, 3, BLOCK)
            await a.store.put_many(ks, data)
            assert sum(a.store.tier_of(k) == "ssd" for k in ks) == 4
            # Only 2 DRAM slots on a: read in pairs, each locate promotes from SSD.
            for i in range(0, 6, 2):
                dsts = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
                assert await b.node.get_many(a.address, ks[i:i + 2], dsts) == [True, True]
                assert [d.tobytes() for d in dsts] == [x.tobytes() for x in data[i:i + 2]]
        finally:
            await a.close()
            await b.close()
    run(main())


@pytest.fixture
def node_process(tmp_path):
    """A store node in its own process, holding 8 blocks of its own (seed 5)."""
    procs = []

    def start(node_id="c", fill=8, seed=5):
        cmd = [sys.executable, "-m", "mooncaked.store.node", "--node-id", node_id,
               "--block-bytes", str(BLOCK), "--dram-bytes", str(4 * BLOCK),
               "--ssd-dir", str(tmp_path / node_id), "--ssd-bytes", str(32 * BLOCK),
               "--fill", str(fill), "--seed", str(seed)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


async def _ready(proc, timeout=30):
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)
    if not line:
        raise AssertionError(f"store node exited with {proc.wait(timeout=5)}")
    return json.loads(line)


def test_across_processes_byte_exact_and_dead_peer(node_process):
    async def main():
        proc = node_process()
        ready = await _ready(proc)
        addr = ready["control"]
        ks = fill_keys(8, 5)
        assert ready["filled"] == [k.hex() for k in ks]
        data = fill_blocks(8, 5, BLOCK)  # the bytes the other process stored
        b = await start_node("b", BLOCK, dram(16))
        try:
            tiers, prefix = await b.node.query(addr, ks)
            assert prefix == 8 and tiers.count("ssd") == 4  # 4 DRAM slots there
            dsts = [np.zeros(BLOCK, np.uint8) for _ in ks]
            for i in range(0, 8, 4):  # at most 4 at once fit its DRAM
                assert await b.node.get_many(addr, ks[i:i + 4], dsts[i:i + 4]) == [True] * 4
            assert all(d.tobytes() == x.tobytes() for d, x in zip(dsts, data))
            # A replica here, then blocks of ours stored there.
            assert all(r.ok for r in await b.node.fetch(addr, ks[:2]))
            assert await b.store.get(ks[1]) == data[1].tobytes()
            mine, my_data = fill_keys(3, 9), fill_blocks(3, 9, BLOCK)
            res = await b.node.put_many(addr, mine, my_data)
            assert [r.status for r in res] == [PutStatus.STORED] * 3
            await b.store.remove_many(mine)
            back = [np.zeros(BLOCK, np.uint8) for _ in mine]
            assert await b.node.get_many(addr, mine, back) == [True] * 3
            assert all(x.tobytes() == y.tobytes() for x, y in zip(back, my_data))
            # A dead peer is reported, not hung on.
            proc.kill()
            proc.wait(timeout=10)
            with pytest.raises(PeerUnavailable):
                await b.node.get_many(addr, ks[:1], dsts[:1])
        finally:
            await b.close()
    run(main())
