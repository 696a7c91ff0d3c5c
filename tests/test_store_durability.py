"""The store tells the truth about a batch put, and its SSD tier is durable head first.

- put_many never evicts its own keys to make room for itself; each key's result
  says what the store holds after the call; a shortage reads as a shortage
  (issue 18, fault 3);
- a clean close persists what DRAM holds; a process killed (SIGKILL) part-way
  through writing a prefix leaves a head of it on SSD, never a tail without its
  head (issue 18, fault 2).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mooncaked.config import StoreSettings
from mooncaked.store import DRAM, SSD, PutStatus, block_keys, make_salt
from mooncaked.store.ssd import HEADER_BYTES
from mooncaked.store.store import BlockStore
from mooncaked.store.types import NO_ROOM

BLOCK = 4096


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def keys(n):
    return block_keys(list(range(4 * n)), 4, make_salt("durable", 4, "f32"))


def settings(dram_blocks, ssd_blocks=0):
    return StoreSettings(dram_bytes=dram_blocks * BLOCK, ssd_bytes=ssd_blocks * (BLOCK + HEADER_BYTES))


def test_batch_larger_than_dram_keeps_its_head_and_reports_the_rest_as_no_room():
    async def main():
        ks, data = keys(10), blocks(10)
        async with BlockStore(BLOCK, settings(4)) as st:
            results = await st.put_many(ks, data)
            assert [r.status for r in results] == [PutStatus.STORED] * 4 + [PutStatus.FAILED] * 6
            assert [r.tier for r in results[:4]] == [DRAM] * 4
            assert all(r.reason.startswith(NO_ROOM) and "pinned by readers" in r.reason
                       and "4 hold this batch's blocks" in r.reason for r in results[4:])
            # Every result is true after the call.
            assert [st.exists(k) for k in ks] == [r.ok for r in results]
            assert st.longest_prefix(ks) == 4
            assert st.metrics.io_errors == 0 and st.metrics.put_failed == 6
            for k, d in zip(ks[:4], data[:4]):
                assert await st.get(k) == d.tobytes()
    run(main())


def test_batch_over_dram_and_ssd_reports_exactly_what_is_held(tmp_path):
    async def main():
        ks, data = keys(10), blocks(10, seed=1)
        async with BlockStore(BLOCK, settings(2, 4), ssd_dir=str(tmp_path)) as st:
            results = await st.put_many(ks, data)
            held = [st.tier_of(k) for k in ks]
            assert [r.ok for r in results] == [h is not None for h in held]
            # The SSD tier (4 slots) holds the whole of what is kept, DRAM its head.
            assert held == [DRAM, DRAM, SSD, SSD] + [None] * 6
            assert [r.tier for r in results[:4]] == [DRAM, DRAM, SSD, SSD]
            assert all(r.reason.startswith(NO_ROOM) for r in results[4:])
            assert st.metrics.io_errors == 0
            for k, d in zip(ks[:4], data[:4]):
                assert await st.get(k) == d.tobytes()
    run(main())


def test_clean_close_persists_dram_blocks(tmp_path):
    async def main():
        ks, data = keys(6), blocks(6, seed=2)
        async with BlockStore(BLOCK, settings(16, 16), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
        async with BlockStore(BLOCK, settings(16, 16), ssd_dir=str(tmp_path)) as st:
            assert st.longest_prefix(ks) == 6 and [st.tier_of(k) for k in ks] == [SSD] * 6
            for k, d in zip(ks, data):
                assert await st.get(k) == d.tobytes()
    run(main())


@pytest.mark.parametrize("crash_at", [3, 6])
def test_crash_mid_write_leaves_a_head_of_the_prefix(tmp_path, crash_at):
    """A process putting a 10-block prefix (4 DRAM slots, so the batch overflows to SSD)
    is killed by SIGKILL just before its `crash_at`-th SSD header write: the SSD then
    holds exactly the first crash_at - 1 blocks (the head), never a tail."""
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_store_durability import BLOCK, keys, blocks, settings
        from mooncaked.store import ssd
        from mooncaked.store.store import BlockStore
        headers = 0
        real = os.pwrite
        def pwrite(fd, data, offset):
            global headers
            if len(data) == ssd.HEADER_BYTES and bytes(data[:8]) == ssd.MAGIC:
                headers += 1
                if headers == {crash_at}:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(fd, data, offset)
        ssd.os.pwrite = pwrite
        async def main():
            async with BlockStore(BLOCK, settings(4, 16), ssd_dir={str(tmp_path)!r}) as st:
                await st.put_many(keys(10), blocks(10, seed=4))
        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, timeout=60,
                          capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]

    async def read():
        ks, data = keys(10), blocks(10, seed=4)
        async with BlockStore(BLOCK, settings(4, 16), ssd_dir=str(tmp_path)) as st:
            held = [st.tier_of(k) for k in ks]
            assert held == [SSD] * (crash_at - 1) + [None] * (11 - crash_at)
            for k, d in zip(ks[:crash_at - 1], data):
                assert await st.get(k) == d.tobytes()
    run(read())
