"""SSD tier of the KV store: restart, corruption, disk full and permission errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mooncaked.config import StoreSettings
from mooncaked.store import SSD, PutStatus, StoreError, block_keys, make_salt
from mooncaked.store.ssd import HEADER_BYTES
from mooncaked.store.store import BlockStore

BLOCK = 4096


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def keys(n):
    return block_keys(list(range(4 * n)), 4, make_salt("t", 4, "f32"))


def blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def ssd_only(n_blocks=64, **kw):
    """No DRAM: every put goes to the SSD tier."""
    return StoreSettings(dram_bytes=0, ssd_bytes=n_blocks * (BLOCK + HEADER_BYTES), **kw)


def test_restart_new_object_serves_ssd_blocks(tmp_path):
    ks, data = keys(6), blocks(6)

    async def write():
        s = StoreSettings(dram_bytes=8 * BLOCK, ssd_bytes=10 * (BLOCK + HEADER_BYTES))
        async with BlockStore(BLOCK, s, ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)  # all fit in DRAM; written through to SSD
            assert [st.tier_of(k) for k in ks] == ["dram"] * 6

    async def read():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            # A clean close persisted every block (whether or not the background write ran).
            assert sorted(st.inventory().tiers[SSD]) == sorted(ks)
            assert st.longest_prefix(ks) == 6
            for k, d in zip(ks, data):
                assert await st.get(k) == d.tobytes()
            assert st.metrics.hits[SSD] == 6 and st.metrics.corrupt == 0

    run(write())
    run(read())


def test_second_process_cannot_share_the_directory(tmp_path):
    async def main():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)):
            with pytest.raises(StoreError, match="in use"):
                await BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)).start()
    run(main())


def test_restart_new_process_serves_ssd_blocks(tmp_path):
    """A block stored by one process is served, byte-exact, by a later one."""
    script = textwrap.dedent(f"""
        import asyncio, sys, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_store_ssd import BLOCK, keys, blocks, ssd_only
        from mooncaked.store.store import BlockStore
        async def main():
            async with BlockStore(BLOCK, ssd_only(), ssd_dir={str(tmp_path)!r}) as st:
                rs = await st.put_many(keys(5), blocks(5, seed=3))
                assert all(r.status.value == "stored" for r in rs), rs
        asyncio.run(main())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)

    async def read():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            for k, d in zip(keys(5), blocks(5, seed=3)):
                assert await st.get(k) == d.tobytes()
    run(read())


def _corrupt_cases(st, ks):
    """Damages the slots of ks[:4] in different ways (in the slot file); returns their keys."""
    data_path = st.ssd.data_path
    off = {k: st.ssd.offset_of(k) for k in ks}
    with open(data_path, "r+b") as f:
        f.seek(off[ks[0]] + 1234)  # a flipped payload byte
        b = f.read(1)
        f.seek(off[ks[0]] + 1234)
        f.write(bytes([b[0] ^ 0x01]))
        f.seek(off[ks[1]] + BLOCK // 2)  # a torn write: the second half never landed
        f.write(bytes(BLOCK // 2))
        f.seek(off[ks[5]])  # another block's (valid) bytes in this block's slot
        other = f.read(BLOCK)
        f.seek(off[ks[2]])
        f.write(other)
    # A truncated file: cut inside the slot of the block stored last.
    last = max(ks[:7], key=lambda k: off[k])
    os.truncate(data_path, off[last] + BLOCK // 3)
    return [ks[0], ks[1], ks[2], last]


def test_corrupt_files_are_misses_not_bad_data(tmp_path):
    async def main():
        ks, data = keys(7), blocks(7)
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
            bad = _corrupt_cases(st, ks)
            q = st.subscribe()
            dst = np.zeros(BLOCK, np.uint8)
            for k in bad:
                assert await st.get_into(k, dst) is None
                assert not st.exists(k)
            assert st.metrics.corrupt == 4 and st.metrics.misses == 4
            # The intact blocks are still served exactly.
            for k, d in zip(ks, data):
                if k not in bad:
                    assert await st.get(k) == d.tobytes()
            st.events.flush()
            events = q.get_nowait()
            assert [(e.kind, e.tier) for e in events] == [("evicted", SSD)]
            assert list(events[0].keys) == bad
    run(main())


def test_corruption_found_after_restart_too(tmp_path):
    async def main():
        ks, data = keys(7), blocks(7)
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
            bad = _corrupt_cases(st, ks)
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            for k, d in zip(ks, data):
                assert await st.get(k) == (None if k in bad else d.tobytes())
            assert st.metrics.corrupt == len(bad)
        # A damaged header (in the header table) drops that block at the next start.
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            good = [k for k in ks if k not in bad]
            slot = st.ssd.offset_of(good[0]) // st.ssd.slot_bytes
            index_path = st.ssd.index_path
        with open(index_path, "r+b") as f:
            f.seek(slot * HEADER_BYTES + 40)
            b = f.read(1)
            f.seek(slot * HEADER_BYTES + 40)
            f.write(bytes([b[0] ^ 0x10]))
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            assert st.ssd.corrupt_at_open == 1 and not st.exists(good[0])
            for k in good[1:]:
                assert await st.get(k) == data[ks.index(k)].tobytes()
    run(main())


def test_ssd_dir_is_a_file_is_reported(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")

    async def main():
        s = StoreSettings(dram_bytes=2 * BLOCK, ssd_bytes=10 * (BLOCK + HEADER_BYTES))
        async with BlockStore(BLOCK, s, ssd_dir=str(not_a_dir)) as st:
            assert st.stats()["ssd_error"].startswith("ENOTDIR:")
            ks, data = keys(3), blocks(3)
            # DRAM still works; a block that needs the SSD tier is reported as not stored
            # (the batch does not evict its own head to make room).
            results = await st.put_many(ks, data)
            assert [r.status for r in results] == [PutStatus.STORED] * 2 + [PutStatus.FAILED]
            assert results[2].reason.startswith("ENOTDIR")
            assert [st.exists(k) for k in ks] == [True, True, False]
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(not_a_dir)) as st:
            r = await st.put(ks[0], data[0])
            assert r.status is PutStatus.FAILED and "ENOTDIR" in r.reason
            assert st.metrics.put_failed == 1 and st.metrics.io_errors == 1
    run(main())


def _make_unwritable(path):
    """Makes directory `path` and its files unwritable, also for root.
    Returns (undo function, the errno name writes now fail with), or None if this host
    cannot do it (root on a file system without the immutable attribute)."""
    dirs = [path] + [os.path.join(path, d) for d in os.listdir(path)]
    if os.geteuid() != 0:
        for d in dirs:
            os.chmod(d, 0o500)
        return (lambda: [os.chmod(d, 0o700) for d in dirs]), "EACCES"
    # root ignores mode bits; the immutable attribute (CAP_LINUX_IMMUTABLE) binds root too.
    r = subprocess.run(["chattr", "+i", *dirs], capture_output=True, timeout=10)
    if r.returncode != 0:
        return None
    return (lambda: subprocess.run(["chattr", "-i", *dirs], capture_output=True, timeout=10)), "EPERM"


def test_permission_denied_is_reported_and_old_blocks_served(tmp_path):
    ks, data = keys(4), blocks(4)

    async def write():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks[:2], data[:2])

    async def use_unwritable(errno_name):
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            assert st.stats()["ssd_error"].split(":")[0] == errno_name
            for k, d in zip(ks[:2], data[:2]):
                assert await st.get(k) == d.tobytes()
            for k, d in zip(ks[2:], data[2:]):
                r = await st.put(k, d)
                assert r.status is PutStatus.FAILED
                assert r.reason.split(":")[0] == errno_name
                assert not st.exists(k)
            assert st.metrics.put_failed == 2

    run(write())
    made = _make_unwritable(str(tmp_path))
    if made is None:
        pytest.skip("cannot make a directory unwritable for root here (no chattr +i)")
    undo, errno_name = made
    try:
        run(use_unwritable(errno_name))
    finally:
        undo()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (root only); skipped where mounting is not permitted."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, timeout=10)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_disk_full_is_reported_and_nothing_half_written(tiny_fs):
    async def main():
        ks, data = keys(24), blocks(24)
        # The configured capacity (1 MiB) exceeds the real disk (64 KiB): ENOSPC.
        s = StoreSettings(dram_bytes=0, ssd_bytes=1 << 20)
        async with BlockStore(BLOCK, s, ssd_dir=str(tiny_fs)) as st:
            results = await st.put_many(ks, data)
            stored = [r.status is PutStatus.STORED for r in results]
            # 64 KiB of tmpfs = 16 pages of 4 KiB: the preallocated header table (256
            # slots * 64 bytes) takes 4, 12 hold slots.
            assert sum(stored) == 12  # which 12 varies: put_many writes slots concurrently
            failed = [r for r in results if r.status is PutStatus.FAILED]
            assert failed and all(r.reason.startswith("ENOSPC") for r in failed)
            assert st.metrics.put_failed == len(failed) and st.metrics.io_errors == len(failed)
            for k, d, ok in zip(ks, data, stored):
                assert await st.get(k) == (d.tobytes() if ok else None)
            assert st.ssd.used_bytes == sum(stored) * st.ssd.slot_bytes
        # Nothing half-written comes back after a restart: exactly the stored blocks.
        async with BlockStore(BLOCK, s, ssd_dir=str(tiny_fs)) as st:
            assert sorted(st.inventory().tiers[SSD]) == sorted(k for k, ok in zip(ks, stored) if ok)
            assert st.ssd.corrupt_at_open == 0
    run(main())


def test_ssd_capacity_evicts_lru_but_not_pinned(tmp_path):
    async def main():
        ks, data = keys(8), blocks(8)
        async with BlockStore(BLOCK, ssd_only(4), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks[:4], data[:4])
            lease = st.lease([ks[3]], ttl_s=60)  # the LRU one after put_many's touch order
            for k, d in zip(ks[4:], data[4:]):
                assert (await st.put(k, d)).tier == SSD
            assert st.exists(ks[3]) and len(st.ssd) == 4
            assert st.metrics.evictions[SSD] == 4
            assert await st.get(ks[3]) == data[3].tobytes()
            st.release(lease)
    run(main())


def test_blocks_written_with_crc32_are_still_verified(tmp_path, monkeypatch):
    """The header records the checksum kind, so a tier without xxhash (crc32) and one
    with it read each other's blocks, and corruption is caught either way."""
    from mooncaked.store import ssd as ssd_mod

    ks, data = keys(3), blocks(3)

    async def write():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
            return st.ssd.data_path, st.ssd.offset_of(ks[1])

    monkeypatch.setattr(ssd_mod, "CSUM_KIND", ssd_mod.CSUM_CRC32)
    data_path, off = run(write())
    monkeypatch.undo()
    with open(data_path, "r+b") as f:
        f.seek(off + 7)
        f.write(bytes([data[1][7] ^ 0xFF]))

    async def read():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            assert st.ssd.index.tag_of(ks[0])[0] == ssd_mod.CSUM_CRC32  # (kind, value)
            assert await st.get(ks[0]) == data[0].tobytes()
            assert await st.get(ks[1]) is None and st.metrics.corrupt == 1
    run(read())


def _flip_byte(st, key, at):
    """Corrupts one byte of `key`'s slot through the file (the page cache keeps it warm)."""
    with open(st.ssd.data_path, "r+b") as f:
        f.seek(st.ssd.offset_of(key) + at)
        b = f.read(1)
        f.seek(st.ssd.offset_of(key) + at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("path", ["split", "pieces", "threads"])
def test_every_read_path_verifies_every_block(tmp_path, path):
    """A warm batch split between the loop's thread and an I/O thread ("split"; "pieces":
    also each block copied and hashed in pieces), and a batch read by the I/O threads
    in slot runs ("threads", as when the page cache is cold), all catch a corrupt
    block wherever it sits in the batch, and put every intact block's bytes in its own
    buffer even when the keys are not in slot order."""
    n = 12
    ks, data = keys(n), blocks(n, seed=5)

    async def main():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
            order = [*ks[6:], *reversed(ks[:6])]  # two runs of slots, one of them reversed
            bad = {ks[6], ks[9], ks[3]}  # the first block read (the probe), one near, one far
            for k in bad:
                _flip_byte(st, k, 3000)  # in the last of 4 pieces in "pieces"
            if path != "threads":
                st.ssd.split_read_bytes = 0
                st.ssd.verify_piece = BLOCK // 4 if path == "pieces" else BLOCK
            else:
                st.ssd._nowait = False  # no page-cache fast path: every block via the threads
            dsts = [np.zeros(BLOCK, np.uint8) for _ in order]
            got = await st.get_many(order, dsts)
            for k, tier, dst in zip(order, got, dsts):
                if k in bad:
                    assert tier is None and not st.exists(k)
                else:
                    assert tier == SSD and dst.tobytes() == data[ks.index(k)].tobytes()
            assert st.metrics.corrupt == 3
            warm = st.ssd.warm_reads
            if path != "threads":  # all from the page cache (by either reader), none to the threads
                assert warm["inline"] + warm["helper"] == n
            else:
                assert warm == {"inline": 0, "helper": 0}
    run(main())


def test_the_helper_thread_verifies_what_it_reads(tmp_path):
    """The I/O thread that shares a large warm batch (which blocks it takes depends on
    scheduling) reads through the same checks: run alone on a batch, it reports the
    corrupt block and reads the others exactly."""
    from mooncaked.store.ssd import CORRUPT, OK, _WarmBatch

    n = 6
    ks, data = keys(n), blocks(n, seed=9)

    async def main():
        async with BlockStore(BLOCK, ssd_only(), ssd_dir=str(tmp_path)) as st:
            await st.put_many(ks, data)
            _flip_byte(st, ks[4], 4000)
            st.ssd.verify_piece = BLOCK // 2  # a block in two pieces
            dsts = [memoryview(np.zeros(BLOCK, np.uint8)) for _ in ks]
            batch = _WarmBatch([(i, *st.ssd.index.entry(k), d)
                                for i, (k, d) in enumerate(zip(ks, dsts))])
            await asyncio.get_running_loop().run_in_executor(
                st.ssd._pool, st.ssd._read_shared, batch, -1, "helper")
            assert batch.counts == {"helper": n} and not batch.close()
            assert [batch.results[j][0] for j in range(n)] == [OK] * 4 + [CORRUPT, OK]
            for j in (0, 5):
                assert bytes(dsts[j]) == data[j].tobytes()
    run(main())
