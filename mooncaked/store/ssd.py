"""The SSD tier: fixed-size block slots in one file, plus a persistent header table.

Layout, in `directory`, for blocks of B bytes (so blocks of another size, e.g.
another model, live in other files and never mix):

    kv-B.dat   slot i at byte i * S, where S = B rounded up to 4 KiB (page-aligned
               slots: no read-modify-write of partial pages)
    kv-B.idx   header i at byte i * 64 (all zeros = free slot):
               magic "MCKVSLT1" | version u16 | key_len u8 | checksum kind u8 |
               payload_len u32 | header_crc32 u32 | payload checksum u64 |
               stored_ns u64 | key (24 bytes) | 4 zero bytes

Why slots in one file (not a file per block, nor an append log): blocks are
immutable and all the same size, so the tier is a DRAM-pool-like slot array
on disk. Compared with a file per block it saves the create/rename/unlink
metadata work on every block (measured here: ~2x the cost of the data write
for 720 KiB blocks while the page cache absorbs writes) and keeps a single
open file; compared with an append log it needs no compaction: a freed slot
is reused in place. The header table is the persistent index: a restart reads
it in one sequential read (64 bytes per slot) and serves the blocks again.

Atomicity and integrity without temp files: a block is written payload first,
header last, and is indexed in memory only after both writes. A batch writes
its payloads in parallel, then its headers in batch order from one thread, so
a crash part-way leaves a head of the batch readable, never only its tail (the
store passes a prefix's blocks head first). The header table is preallocated
at open, so a full disk fails payload writes, never the header of a block
whose payload was written. A slot is reused
only when no reader pins it, and its old header is zeroed before the new
payload is written. After a crash (no fsync by default: this is a cache) a
slot may hold any mix of old and new bytes, so every read checks the payload
against the checksum in its header and the header against its own CRC32: a
torn, truncated (short read) or corrupt slot is a miss, counted and logged,
its slot freed; never another block's bytes.

The payload checksum is XXH3-64 (the `xxhash` package, AVX-512 here): 44 GB/s
from memory, 65-70 GB/s from the CPU cache, against 3.8 GB/s for zlib.crc32.
Verifying a block just copied costs about a fifth of the copy from the page
cache (perf: 19%); with Python's per-block work, one thread reads and verifies
at 0.75-0.82x a plain read's CPU time (with crc32 the check alone capped warm
reads at ~0.35x). Without `xxhash` the tier falls back
to zlib.crc32; the header records which one was used.

I/O runs in a thread pool, one hop per chunk of a batch (pread/pwrite with
explicit offsets are thread-safe); aiofiles would add one hop per call and
offers no positional I/O. A read first tries the page cache without blocking
(preadv2 with RWF_NOWAIT) on the caller's thread, up to INLINE_READ_BYTES per
batch: a warm block then costs a copy and its checksum, no thread hop; a warm
batch of SPLIT_READ_BYTES or more is shared block by block with one I/O thread
when a CPU is idle (both release the GIL in preadv and xxh3), so one block's
checksum overlaps another's copy. Blocks not cached go to the threads in runs of adjacent
slots, each run read in order by one thread: the kernel then reads ahead into
large page-cache folios, as for a plain sequential read, and later warm reads
copy at full speed. Every block is verified on every path, right after its
copy while it is in the CPU cache. The directory is locked (flock) against a
second process.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mooncaked.log import get_logger
from mooncaked.utils import cdiv

from .slots import SlotIndex, SlotTier
from .types import NO_ROOM, StoreError

log = get_logger(__name__)

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; crc32 keeps the tier working
    xxhash = None

MAGIC = b"MCKVSLT1"
VERSION = 1
HEADER_BYTES = 64
MAX_KEY_BYTES = 24
ALIGN = 4096
_HEADER = struct.Struct("<8sHBBIIQQ24s4x")  # 64 bytes
_HCRC = slice(16, 20)  # header_crc32's bytes
_ZERO_HEADER = bytes(HEADER_BYTES)

CSUM_CRC32 = 1
CSUM_XXH3_64 = 2
_CSUM_FUNCS = {CSUM_CRC32: zlib.crc32}
if xxhash is not None:
    _CSUM_FUNCS[CSUM_XXH3_64] = xxhash.xxh3_64_intdigest
CSUM_KIND = CSUM_XXH3_64 if xxhash is not None else CSUM_CRC32
"""Checksum kind used for new blocks."""


def checksum(kind: int, data) -> int | None:
    """Checksum of `data` (bytes-like) by `kind`, or None if that kind is unavailable."""
    fn = _CSUM_FUNCS.get(kind)
    return None if fn is None else fn(data)

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
INLINE_READ_BYTES = 64 << 20
"""Most bytes one read_many copies and verifies from the page cache on the event loop's
thread (with at most one helper thread; about 10 ms of the loop at page-cache speed);
the rest, and every block not cached, go to the I/O threads' blocking path. A thread
hop per chunk costs a scheduling round trip, which on a loaded host is what capped
warm reads (issue 18)."""

SPLIT_READ_BYTES = 8 << 20
"""A warm batch of at least this many bytes is shared, block by block, with one idle I/O
thread when a CPU is idle (`spare_cpu`); a smaller one is read on the event loop's
thread alone, where the executor hop (tens of microseconds idle, milliseconds on a
loaded host) would cost more than the overlap saves."""

VERIFY_PIECE_BYTES = 1 << 20
"""Warm reads copy and hash a larger block in pieces of this many bytes, each hashed while
it is mostly in the core's L2 cache (see SsdTier._read_block_cached)."""

# Outcomes of a read.
OK = "ok"
MISSING = "missing"
CORRUPT = "corrupt"
ERROR = "error"


def pack_header(key: bytes, payload_len: int, csum: tuple[int, int], stored_ns: int) -> bytes:
    """The 64-byte header of a slot holding block `key`; `csum` is (kind, value)."""
    raw = bytearray(_HEADER.pack(MAGIC, VERSION, len(key), csum[0], payload_len, 0, csum[1],
                                 stored_ns, key))
    raw[_HCRC] = zlib.crc32(raw).to_bytes(4, "little")
    return bytes(raw)


def unpack_header(raw: bytes) -> tuple[bytes, int, tuple[int, int], int] | None:
    """(key, payload_len, (checksum kind, value), stored_ns) of a valid header, else None."""
    if len(raw) != HEADER_BYTES or raw[:8] != MAGIC:
        return None
    _magic, version, key_len, kind, plen, hcrc, value, stored_ns, key = _HEADER.unpack(raw)
    zeroed = bytearray(raw)
    zeroed[_HCRC] = b"\0\0\0\0"
    if version != VERSION or key_len > MAX_KEY_BYTES or zlib.crc32(zeroed) != hcrc:
        return None
    return key[:key_len], plen, (kind, value), stored_ns


def errno_reason(e: OSError) -> str:
    """A short reason for an OSError, e.g. "ENOSPC: No space left on device"."""
    name = errno.errorcode.get(e.errno or 0, "EIO")
    return f"{name}: {e.strerror or e}"


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def spare_cpu() -> bool:
    """True if a CPU this process may use is idle now, besides the calling thread: fewer
    runnable tasks system-wide (the 4th field of /proc/loadavg, the caller included)
    than such CPUs. True where /proc/loadavg cannot be read (not Linux)."""
    global _loadavg_fd
    try:
        if _loadavg_fd < 0:
            _loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        running = int(os.pread(_loadavg_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running < len(os.sched_getaffinity(0))


_loadavg_fd = -1  # kept open: a pread costs a few microseconds, an open ten more


class _WarmBatch:
    """Blocks of one warm read shared by the threads reading them (`SsdTier._read_warm`):
    each takes the next block not taken yet and puts back its outcome (None: not cached,
    which stops the batch for every reader). Thread-safe; `close()` (event loop's
    thread) hands the blocks nobody took to the caller."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self.results: dict[int, tuple[str, str]] = {}  # job index -> (outcome, reason)
        self.counts: dict[str, int] = {}  # blocks read from the page cache, per reader
        self._next = 0
        self._held = 0  # blocks taken and not put back
        self._closed = False
        self._lock = threading.Lock()

    def take(self, who: str) -> int | None:
        """The index of the next block for reader `who`, or None when the batch is done."""
        with self._lock:
            if self._closed or self._next >= len(self.jobs):
                return None
            self._next += 1
            self._held += 1
            return self._next - 1

    def put(self, who: str, j: int, result: tuple[str, str] | None) -> None:
        """Block j's outcome from reader `who`; None (not cached) stops the batch."""
        with self._lock:
            self._held -= 1
            if result is None:
                self._closed = True
            else:
                self.results[j] = result
                self.counts[who] = self.counts.get(who, 0) + 1

    def close(self) -> bool:
        """Stops handing out blocks; True while a reader still holds one."""
        with self._lock:
            self._closed = True
            return self._held > 0


class SsdTier(SlotTier):
    """Block slots in one file under `directory`, at most `capacity_bytes` of them.

    Which slot holds which key (with its checksum as the slot's tag), the free
    slots and the eviction order are `index`, the same books the DRAM pool keeps.

    Args:
        directory: where the slot and header files live (created if missing).
        capacity_bytes: bytes of the slot file; `capacity_bytes // slot_bytes` slots.
        block_bytes: payload bytes of one block.
        can_evict: predicate from the store (false for pinned/leased keys).
        on_evict: called with the keys evicted to make room (for events/metrics).
        policy: "lru", "sieve" or "fifo".
        fsync: fdatasync after each block (durable across power loss; off by
            default since the tier is a cache).
        io_threads: threads doing file I/O.
    Use `await open()` before anything else and `close()` at the end.
    Raises: ValueError for an unknown policy.
    """

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int,
                 can_evict: Callable[[bytes], bool], on_evict: Callable[[list[bytes]], None],
                 policy: str = "lru", fsync: bool = False, io_threads: int = 4):
        self.directory = os.path.abspath(directory)
        self.block_bytes = block_bytes
        self.slot_bytes = cdiv(block_bytes, ALIGN) * ALIGN
        self.index = SlotIndex(capacity_bytes // self.slot_bytes, policy)
        self.capacity_bytes = self.num_slots * self.slot_bytes
        self.data_path = os.path.join(self.directory, f"kv-{block_bytes}.dat")
        self.index_path = os.path.join(self.directory, f"kv-{block_bytes}.idx")
        self._can_evict = can_evict
        self._on_evict = on_evict
        self.fsync = fsync
        self._data_fd = -1
        self._idx_fd = -1
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-ssd")
        self.error = ""  # why the tier cannot write (empty if it can)
        self.corrupt_at_open = 0  # invalid headers found (and freed) by open()
        self._last_errno: int | None = None
        self._nowait = _RWF_NOWAIT != 0  # warm reads on the caller's thread (read_many)
        self.split_read_bytes = SPLIT_READ_BYTES
        self.verify_piece = VERIFY_PIECE_BYTES
        self._inflight = 0  # pool jobs submitted and not finished (event loop's count)
        self.warm_reads = {"inline": 0, "helper": 0}  # blocks read by _read_warm, by thread
        self._local = threading.local()  # per I/O thread: its descriptor for reads
        self._reader_fds: list[int] = []
        self._fds_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def _run(self, fn, *args):
        self._inflight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._inflight -= 1

    async def open(self) -> None:
        """Opens (or creates) the slot and header files and indexes the blocks in them.

        An unwritable directory or file is not fatal: the reason is logged and
        kept in `error`, blocks already there are served if the files can be read,
        and puts fail with that reason.
        Raises: StoreError if another process holds the directory's lock.
        """
        t0 = time.perf_counter()
        await self._run(self._open_files)
        if self._idx_fd >= 0:
            entries = await self._run(self._read_index)
            self._load_index(entries)
        if self.error:
            log.error("ssd_tier_not_writable", dir=self.directory, reason=self.error)
        log.info("ssd_tier_opened", dir=self.directory, blocks=len(self.index),
                 slots=self.num_slots, slot_bytes=self.slot_bytes,
                 corrupt_headers=self.corrupt_at_open, open_s=round(time.perf_counter() - t0, 3))

    def _open_files(self) -> None:
        try:
            os.makedirs(self.directory, 0o700, exist_ok=True)
        except OSError:
            pass  # opening the files below reports the real reason
        fds = []
        for path in (self.index_path, self.data_path):
            try:
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            except OSError as e:
                self.error = self.error or errno_reason(e)
                try:  # read-only media or files: serve what is there
                    fds.append(os.open(path, os.O_RDONLY))
                except OSError:
                    fds.append(-1)
        self._idx_fd, self._data_fd = fds
        if self._idx_fd >= 0:
            try:
                fcntl.flock(self._idx_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._close_files()
                raise StoreError(f"SSD tier {self.directory} is in use by another "
                                 "process") from None
        if self._data_fd < 0 and self._idx_fd >= 0:
            os.close(self._idx_fd)
            self._idx_fd = -1
        if self._idx_fd >= 0 and not self.error and self.num_slots:
            try:  # every header has its bytes: a full disk fails payloads, not headers
                os.posix_fallocate(self._idx_fd, 0, self.num_slots * HEADER_BYTES)
            except OSError as e:
                log.warning("ssd_index_preallocate_failed", reason=errno_reason(e))

    def _read_index(self) -> list[bytes]:
        raw = b""
        size = os.fstat(self._idx_fd).st_size
        if size:
            raw = os.pread(self._idx_fd, size, 0)
        n = len(raw) // HEADER_BYTES
        return [raw[i * HEADER_BYTES: (i + 1) * HEADER_BYTES] for i in range(n)]

    def _load_index(self, entries: list[bytes]) -> None:
        found = []
        stale = []  # slots to zero: invalid headers, duplicates, beyond capacity
        for i, raw in enumerate(entries):
            if raw == _ZERO_HEADER:
                continue
            h = unpack_header(raw)
            if h is None or h[1] != self.block_bytes or i >= self.num_slots:
                if h is None:
                    self.corrupt_at_open += 1
                stale.append(i)
                continue
            found.append((h[3], i, h[0], h[2]))
        found.sort()  # oldest first, so the eviction order starts from the oldest block
        stale += self.index.load((key, slot, csum) for _ns, slot, key, csum in found)
        if self.error or not stale:
            return
        try:
            for slot in stale:
                os.pwrite(self._idx_fd, _ZERO_HEADER, slot * HEADER_BYTES)
            if len(entries) > self.num_slots:  # the capacity shrank: give the space back
                os.ftruncate(self._idx_fd, self.num_slots * HEADER_BYTES)
                os.ftruncate(self._data_fd, self.num_slots * self.slot_bytes)
        except OSError as e:
            log.warning("ssd_index_cleanup_failed", reason=errno_reason(e))

    def _close_files(self) -> None:
        for fd in (self._data_fd, self._idx_fd, *self._reader_fds):
            if fd >= 0:
                os.close(fd)  # also releases the flock
        self._data_fd = self._idx_fd = -1
        self._reader_fds = []

    def close(self) -> None:
        """Waits for running I/O, stops the threads and closes the files (blocking)."""
        self._pool.shutdown(wait=True)
        self._close_files()

    # ------------------------------------------------------------------ index

    def offset_of(self, key: bytes) -> int | None:
        """Byte offset of `key`'s slot in `data_path`, or None."""
        slot = self.index.slot_of(key)
        return None if slot is None else slot * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding blocks."""
        return len(self.index) * self.slot_bytes

    def _take_slot(self) -> tuple[int, bool] | None:
        """(slot, was_in_use) for a new block, evicting one if needed; None if all pinned."""
        taken = self.index.take(self._can_evict)
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None:
            self._on_evict([evicted])
        return slot, evicted is not None

    # ------------------------------------------------------------------ I/O

    def _write_payload(self, slot: int, reused: bool, payload: np.ndarray) -> tuple[int, int]:
        """Writes one block's payload into its slot (zeroing a reused slot's old header
        first); returns its (checksum kind, value). Raises OSError."""
        view = memoryview(payload).cast("B")
        if reused:  # a crash must not leave the old header over new bytes
            os.pwrite(self._idx_fd, _ZERO_HEADER, slot * HEADER_BYTES)
        csum = (CSUM_KIND, checksum(CSUM_KIND, view))
        _pwrite_all(self._data_fd, view, slot * self.slot_bytes)
        return csum

    def _write_headers(self, items: list[tuple[int, bytes]]) -> list[OSError | None]:
        """Runs in one I/O thread: writes (slot, header) in order, after the payloads
        (fdatasync'd first when `fsync`); per item None or the OSError."""
        out: list[OSError | None] = []
        if self.fsync and items:
            try:
                os.fdatasync(self._data_fd)
            except OSError as e:
                return [e] * len(items)
        for slot, header in items:
            try:
                os.pwrite(self._idx_fd, header, slot * HEADER_BYTES)
                out.append(None)
            except OSError as e:
                out.append(e)
        if self.fsync and items:
            try:
                os.fdatasync(self._idx_fd)
            except OSError as e:
                out = [e] * len(items)
        return out

    def _reader_fd(self) -> int:
        """This I/O thread's own read-only descriptor of the slot file. The kernel keeps
        readahead state per open file: threads sharing one descriptor interleave their
        offsets, readahead sees a random pattern and fills the page cache with small
        pages, and later warm reads of those blocks copy at up to half speed. The
        default readahead window is kept: POSIX_FADV_SEQUENTIAL (a doubled window)
        grows the page-cache folios more slowly along a run (measured: 4.8 pages on
        average against 6.0 for 2.9 MB blocks, and 16.5 against 17.1 for 720 KB)."""
        fd = getattr(self._local, "fd", None)
        if fd is None:
            fd = os.open(self.data_path, os.O_RDONLY)
            with self._fds_lock:
                self._reader_fds.append(fd)
            self._local.fd = fd
        return fd

    def _read_job(self, slot: int, csum: tuple[int, int], dst: memoryview) -> tuple[str, str]:
        got, off = 0, slot * self.slot_bytes
        fd = self._reader_fd()
        while got < len(dst):
            n = os.preadv(fd, [dst[got:]], off + got)
            if n == 0:
                return CORRUPT, f"truncated slot: {got} of {len(dst)} bytes"
            got += n
        return self._verify(csum, dst)

    def _read_cached(self, fd: int, offset: int, dst: memoryview) -> bool:
        """Reads `dst` from byte `offset` of the slot file on the calling thread only if
        the page cache holds all of it (preadv2 RWF_NOWAIT: never waits for the
        device); True when `dst` got it all."""
        try:
            n = os.preadv(fd, [dst], offset, _RWF_NOWAIT)
        except BlockingIOError:  # not (all) cached: the I/O threads read it
            return False
        except OSError as e:  # RWF_NOWAIT unsupported here (file system, kernel)
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._nowait = False
            return False
        return n == len(dst)

    def _read_block_cached(self, fd: int, slot: int, csum: tuple[int, int],
                           dst: memoryview) -> tuple[str, str] | None:
        """Reads one block into `dst` only if the page cache holds it and verifies it right
        after the copy, while it is in the CPU cache; (outcome, reason), or None if it was
        not (all) cached.

        A block larger than `verify_piece` bytes with an XXH3 checksum is copied and
        hashed piece by piece (streaming XXH3 gives the same digest), so each piece is
        hashed while it is mostly still in the core's 1 MiB L2 cache (measured, 2.9 MB
        blocks: read plus verify at 0.74-0.81x a plain read's CPU time in one piece,
        0.80-0.86x in 1 MiB or 512 KiB pieces; 720 KB blocks, read whole, 0.80-0.82x,
        and no better in two pieces)."""
        offset = slot * self.slot_bytes
        piece = self.verify_piece
        if len(dst) <= piece or csum[0] != CSUM_XXH3_64 or xxhash is None:
            return self._verify(csum, dst) if self._read_cached(fd, offset, dst) else None
        h = xxhash.xxh3_64()
        for at in range(0, len(dst), piece):
            part = dst[at: at + piece]
            if not self._read_cached(fd, offset + at, part):
                return None
            h.update(part)
        return (OK, "") if h.intdigest() == csum[1] else (CORRUPT, "payload checksum mismatch")

    def _read_shared(self, batch: _WarmBatch, fd: int, who: str) -> None:
        """Takes blocks from `batch` and reads them from the page cache until none is left
        or one is not cached (then `batch` stops for every reader). Runs on the event
        loop's thread (`fd` the tier's) and on at most one I/O thread (`fd` -1: its own)."""
        if fd < 0:
            try:
                fd = self._reader_fd()
            except OSError:  # e.g. EMFILE: the threads' blocking path reports it per block
                return
        while (j := batch.take(who)) is not None:
            _i, slot, csum, dst = batch.jobs[j]
            batch.put(who, j, self._read_block_cached(fd, slot, csum, dst))

    def _verify(self, csum: tuple[int, int], dst: memoryview) -> tuple[str, str]:
        """Checks a block read into `dst` against its header's checksum."""
        value = checksum(csum[0], dst)
        if value is None:
            return CORRUPT, f"checksum kind {csum[0]} not available"
        if value != csum[1]:
            return CORRUPT, "payload checksum mismatch"
        return OK, ""

    def _write_chunk(self, items: list[tuple[int, int, bool, bytes, np.ndarray]]) -> list:
        """Runs in one I/O thread: writes several payloads; per item its checksum or OSError."""
        out = []
        for _i, slot, reused, _key, payload in items:
            try:
                out.append(self._write_payload(slot, reused, payload))
            except OSError as e:
                out.append(e)
        return out

    def _read_chunk(self, items: list[tuple[int, int, tuple[int, int], memoryview]]) -> list:
        """Runs in one I/O thread: reads and verifies several blocks."""
        out = []
        for _i, slot, csum, dst in items:
            try:
                out.append(self._read_job(slot, csum, dst))
            except OSError as e:
                out.append((ERROR, errno_reason(e)))
        return out

    async def _run_chunked(self, fn, items: list) -> list:
        """Runs `fn` over `items` split into at most io_threads contiguous chunks (one
        executor hop per chunk, not per block); results in item order."""
        if not items:
            return []
        n = min(self.io_threads, len(items))
        size = cdiv(len(items), n)
        chunks = [items[i: i + size] for i in range(0, len(items), size)]
        parts = await asyncio.gather(*(self._run(fn, c) for c in chunks))
        return [r for part in parts for r in part]

    async def _read_cold(self, jobs: list) -> list:
        """Reads and verifies `jobs` (i, slot, csum, dst) on the I/O threads; results in
        job order. Slots are read in runs of adjacent slots, each run in slot order by
        one thread, the runs spread over at most io_threads threads. Why: the kernel
        grows its readahead, and the page-cache folios it allocates, only along one
        descriptor's sequential stream; threads splitting one run start mid-stream
        (read as random: single pages) and run into each other's pages. A later warm
        read of single pages copies at ~0.7x the speed of large folios (measured:
        4 threads per run left an average folio of 2 pages, 10-11 GB/s warm; one
        thread 17 pages, 13-15 GB/s; and the cold read itself was faster)."""
        if not jobs:
            return []
        order = sorted(range(len(jobs)), key=lambda j: jobs[j][1])
        runs: list[list[int]] = []
        for j in order:
            if runs and jobs[runs[-1][-1]][1] + 1 == jobs[j][1]:
                runs[-1].append(j)
            else:
                runs.append([j])
        groups: list[list[int]] = [[] for _ in range(min(self.io_threads, len(runs)))]
        for run in sorted(runs, key=len, reverse=True):  # longest first, to the lightest
            min(groups, key=len).extend(run)
        parts = await asyncio.gather(*(
            self._run(self._read_chunk, [jobs[j] for j in sorted(g, key=lambda j: jobs[j][1])])
            for g in groups))
        out: list = [None] * len(jobs)
        for g, part in zip(groups, parts):
            for j, res in zip(sorted(g, key=lambda j: jobs[j][1]), part):
                out[j] = res
        return out

    async def write_many(self, keys: list[bytes], payloads: list[np.ndarray]) -> list[str]:
        """Stores blocks; per key "" on success (or already held) or the reason it was not.

        Payloads (block_bytes bytes each) must not change until this returns. Takes a
        free slot or evicts the policy's victim per block (never a pinned one). Never
        raises for I/O errors (ENOSPC, EACCES, EPERM...): they are the reasons.
        """
        reasons = [""] * len(keys)
        jobs = []
        for i, (key, payload) in enumerate(zip(keys, payloads)):
            if key in self.index:
                continue
            if len(key) > MAX_KEY_BYTES:
                reasons[i] = f"key longer than {MAX_KEY_BYTES} bytes"
            elif self.error:
                reasons[i] = self.error
            elif memoryview(payload).nbytes != self.block_bytes:
                reasons[i] = (f"block of {memoryview(payload).nbytes} bytes, tier holds "
                              f"{self.block_bytes}")
            else:
                taken = self._take_slot()
                if taken is None:
                    reasons[i] = f"{NO_ROOM}: SSD tier full ({self.num_slots} slots, none " \
                        "evictable: pinned, or this batch's)"
                else:
                    jobs.append((i, taken[0], taken[1], key, payload))
        results = await self._run_chunked(self._write_chunk, jobs)
        now = time.time_ns()
        headers = [(slot, pack_header(key, self.block_bytes, res, now))
                   for (_i, slot, _r, key, _p), res in zip(jobs, results)
                   if not isinstance(res, OSError)]
        header_errors = iter(await self._run(self._write_headers, headers) if headers else [])
        for (i, slot, _reused, key, _payload), res in zip(jobs, results):
            if not isinstance(res, OSError):
                res = next(header_errors) or res
            if isinstance(res, OSError):
                self.index.free(slot)
                reasons[i] = errno_reason(res)
                if res.errno != self._last_errno:  # log each new kind of failure once in a row
                    log.error("ssd_write_failed", dir=self.directory, reason=reasons[i])
                    self._last_errno = res.errno
            else:
                self._last_errno = None
                self.index.insert(key, slot, res)
        return reasons

    async def read_many(self, keys: list[bytes], dsts: list[memoryview]) -> list[tuple[str, str]]:
        """Reads blocks into `dsts` (block_bytes each) and verifies them.

        Per key (outcome, reason): OK, MISSING (not held), CORRUPT (short read or
        checksum mismatch: the slot is freed; that dst holds garbage and must not be
        used) or ERROR (an OSError; the block stays indexed). The caller must keep
        the keys pinned meanwhile so their slots are not reused.
        """
        out: list[tuple[str, str]] = [(MISSING, "not held")] * len(keys)
        jobs = []
        for i, (key, dst) in enumerate(zip(keys, dsts)):
            entry = self.index.entry(key)
            if entry is not None:
                jobs.append((i, entry[0], entry[1], dst))
        done, cold = await self._read_warm(jobs)
        results = await self._read_cold(cold)
        for (i, slot, csum, _dst), (outcome, reason) in [*done, *zip(cold, results)]:
            key = keys[i]
            out[i] = (outcome, reason)
            if outcome == OK:
                self.index.touch(key)
            elif outcome == CORRUPT and self.index.entry(key) == (slot, csum):
                log.warning("ssd_block_corrupt", key=key.hex(), slot=slot, reason=reason)
                await self._free_slot(key)
        return out

    async def _read_warm(self, jobs: list) -> tuple[list, list]:
        """Reads and verifies the leading `jobs` (i, slot, csum, dst) that the page cache
        holds, without waiting for the device; returns ([(job, (outcome, reason))], the
        jobs left for `_read_cold`).

        The first block is tried on this thread: if it is not cached the whole batch
        goes to the I/O threads untried (a NOWAIT read of an uncached block still
        starts readahead, and readahead started block by block from here would fill
        the page cache in small pages). If it is, at most INLINE_READ_BYTES are read
        here. For a batch of at least `split_read_bytes`, one idle I/O thread reads
        too: both take the next block from the batch until none is left (preadv and
        xxh3 release the GIL, so one block's checksum overlaps another's copy; measured
        on 2 cores: one thread reads and verifies at 0.75-0.85x a plain read's speed).
        Sharing block by block, not in halves, means a helper that starts late costs
        nothing: this thread does whatever the helper does not reach and waits at most
        for the block the helper has in hand. A helper preempted with a block in hand
        delays the whole batch, though (measured at load 5 on 2 cores: 0.54-0.64x a
        plain read against 0.70 alone), so it is asked only when a CPU is idle now
        (`spare_cpu`). The first miss stops both; the rest goes to the threads.
        """
        if not (self._nowait and self._data_fd >= 0 and jobs):
            return [], jobs
        n, nbytes = 0, 0
        for job in jobs:
            if nbytes + len(job[3]) > INLINE_READ_BYTES:
                break
            n, nbytes = n + 1, nbytes + len(job[3])
        first = self._read_block_cached(self._data_fd, *jobs[0][1:]) if n else None
        if first is None:
            return [], jobs
        self.warm_reads["inline"] += 1
        batch = _WarmBatch(jobs[1:n])
        helper = None
        if (n > 2 and nbytes >= self.split_read_bytes and self._inflight < self.io_threads
                and spare_cpu()):
            self._inflight += 1  # submitted now, so it runs while this thread reads
            helper = asyncio.get_running_loop().run_in_executor(
                self._pool, self._read_shared, batch, -1, "helper")
            helper.add_done_callback(self._helper_done)
        self._read_shared(batch, self._data_fd, "inline")
        if batch.close() and helper is not None:  # the helper holds a block: wait for it
            await helper
        for who, count in batch.counts.items():
            self.warm_reads[who] += count
        done = [(jobs[0], first), *((batch.jobs[j], r) for j, r in batch.results.items())]
        left = [job for j, job in enumerate(batch.jobs) if j not in batch.results]
        return done, [*left, *jobs[n:]]

    def _helper_done(self, fut: asyncio.Future) -> None:
        self._inflight -= 1
        if not fut.cancelled() and fut.exception() is not None:  # a bug: never silent
            log.error("ssd_read_helper_failed", error=repr(fut.exception()))

    async def _free_slot(self, key: bytes) -> None:
        slot = self.index.drop(key)
        if not self.error:
            try:
                await self._run(os.pwrite, self._idx_fd, _ZERO_HEADER, slot * HEADER_BYTES)
            except OSError as e:
                log.warning("ssd_header_clear_failed", slot=slot, reason=errno_reason(e))
        self.index.free(slot)

    async def remove(self, key: bytes) -> bool:
        """Deletes block `key` (its header is zeroed, so a restart does not bring it
        back); True if it was held. The caller checks pins first."""
        if key not in self.index:
            return False
        await self._free_slot(key)
        return True
