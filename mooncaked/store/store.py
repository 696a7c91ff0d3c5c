"""The local object API of the KV store: one node's DRAM pool and SSD tier (paper 3.2.1).

Objects are KV blocks of `block_bytes` bytes keyed by block keys; a key fixes
the bytes, so a put of a held key is a no-op ("exists"). A block lives in
DRAM, on SSD, or both (after a promotion the SSD copy is kept, so demoting it
again costs nothing). Under pressure, blocks move down (DRAM -> SSD, or out
when there is no SSD tier); on use they move up (SSD -> DRAM).

Readers are protected in two ways:
  - pins: held by this process while it copies a block (e.g. an SSD read in
    flight); a pinned block is never evicted, demoted or removed;
  - leases: pins with a deadline, for readers that read the DRAM pool
    directly (a peer through the transfer engine, or the engine copying into
    device pages). Releasing or checking a lease after its deadline raises
    `LeaseExpired`: the bytes read under it may belong to another block.

Every change of what a tier holds is published as a batched `StoreEvent`
(see events.py) for the conductor's global index; `inventory()` lists all keys.

All methods must be called from the event loop's thread. Buffers (`src`,
`dst`) are anything exposing the buffer protocol (bytes, bytearray,
memoryview, numpy arrays) or CPU torch tensors, C-contiguous, of exactly
`block_bytes` bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from typing import Any, Awaitable, Callable, Iterable, Sequence

import numpy as np

from mooncaked.config import Settings, StoreSettings
from mooncaked.log import get_logger

from . import ssd as ssd_mod
from .dram import DramPool
from .events import EventBatcher
from .ssd import SsdTier
from .types import (DRAM, SSD, BlockPinned, Inventory, LeaseExpired, Location, PutResult,
                    PutStatus, StoreError, StoreMetrics)

log = get_logger(__name__)

STORED, EVICTED = "stored", "evicted"


def as_u8(buf: Any, writable: bool = False) -> np.ndarray:
    """A flat uint8 numpy view of `buf` (no copy).

    Accepts bytes-like objects, numpy arrays and CPU torch tensors.
    Raises: ValueError for a non-contiguous or (if `writable`) read-only buffer;
        TypeError for a tensor not on the CPU.
    """
    if isinstance(buf, np.ndarray):
        arr = buf
    elif hasattr(buf, "is_contiguous") and hasattr(buf, "numpy"):  # torch.Tensor
        if buf.device.type != "cpu":
            raise TypeError(f"store buffers must be in CPU memory, got a {buf.device} tensor")
        if not buf.is_contiguous():
            raise ValueError("store buffers must be contiguous")
        # Reinterpret as bytes first: numpy has no bfloat16.
        arr = buf.detach().reshape(-1).view(torch_uint8(buf)).numpy()
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("store buffers must be C-contiguous")
    arr = arr.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("destination buffer is read-only")
    return arr


def torch_uint8(tensor: Any) -> Any:
    """torch.uint8, taken from the tensor's own module (torch stays an optional import)."""
    return sys.modules[type(tensor).__module__.split(".")[0]].uint8


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   itemsize: int) -> int:
    """Bytes of one KV block in the engine's layout: every layer's K and V for
    `block_size` tokens (`kv_cache[block]` of [num_blocks, num_layers, 2, block_size,
    num_kv_heads, head_dim]), e.g. SmolLM2-135M fp32 at block_size 16: 737,280."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


class Lease:
    """Blocks pinned for a reader until `deadline` (event loop clock, seconds).

    Attributes: `id`, `keys` (the blocks pinned), `deadline`, `state`
    ("held", "released" or "expired"). Obtain from `BlockStore.lease()` or
    `locate_many()`; end with `BlockStore.release()`.
    """

    __slots__ = ("id", "keys", "deadline", "state", "_timer")

    def __init__(self, lease_id: int, keys: tuple[bytes, ...], deadline: float):
        self.id, self.keys, self.deadline = lease_id, keys, deadline
        self.state = "held"
        self._timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"Lease(id={self.id}, keys={len(self.keys)}, state={self.state})"


class BlockStore:
    """One node's KV block store: DRAM pool + optional SSD tier, leases, events, metrics.

    Args:
        block_bytes: bytes of one KV block (num_layers*2*block_size*num_kv_heads*
            head_dim*itemsize for the engine's layout).
        settings: the `[store]` section (capacities, eviction policy, ...).
        node_id: stamped on events and used in the pool's segment name.
        ssd_dir: directory of the SSD tier; overrides `settings.ssd_dir`; required
            when `settings.ssd_bytes > 0` and `settings.ssd_dir` is empty.
        segment: name of the DRAM pool's transfer-engine segment (default
            "<node_id>/kv-dram").
    Raises:
        ValueError: block_bytes < 1, or an SSD tier without a directory.
    Use `await start()` first and `await close()` at the end (or `async with`).
    """

    def __init__(self, block_bytes: int, settings: StoreSettings | None = None, *,
                 node_id: str = "local", ssd_dir: str | None = None, segment: str | None = None):
        self.settings = s = settings or StoreSettings()
        self.block_bytes = block_bytes
        self.node_id = node_id
        self.dram = DramPool(s.dram_bytes, block_bytes, segment or f"{node_id}/kv-dram", s.eviction)
        self.ssd: SsdTier | None = None
        if s.ssd_bytes > 0:
            directory = ssd_dir or s.ssd_dir
            if not directory:
                raise ValueError("store.ssd_bytes > 0 needs store.ssd_dir (or ssd_dir=...)")
            self.ssd = SsdTier(directory, s.ssd_bytes, block_bytes, self._can_evict,
                               self._on_ssd_evict, s.eviction, s.ssd_fsync, s.ssd_io_threads)
        self.events = EventBatcher(node_id, s.event_interval_ms / 1000.0, s.event_max_keys)
        self.metrics = StoreMetrics()
        self._pins: dict[bytes, int] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._lease_ids = itertools.count(1)
        self._leases: dict[int, Lease] = {}
        self._background: set[asyncio.Task] = set()  # promotions that needed a demotion

    @classmethod
    def from_settings(cls, settings: Settings, block_bytes: int, node_id: str) -> "BlockStore":
        """A store from the full settings: resolves an empty `store.ssd_dir` to
        `<node.state_dir or $STATE_DIRECTORY or ~/.local/state/mooncaked>/kvstore`."""
        directory = settings.store.ssd_dir
        if not directory:
            state = (settings.node.state_dir or os.environ.get("STATE_DIRECTORY")
                     or os.path.expanduser("~/.local/state/mooncaked"))
            directory = os.path.join(state, "kvstore")
        return cls(block_bytes, settings.store, node_id=node_id, ssd_dir=directory)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "BlockStore":
        """Opens the SSD tier (indexing the blocks a previous run left there)."""
        if self.ssd is not None:
            await self.ssd.open()
        log.info("store_started", node=self.node_id, block_bytes=self.block_bytes,
                 dram_slots=self.dram.num_slots,
                 ssd_blocks=len(self.ssd) if self.ssd is not None else 0)
        return self

    async def close(self) -> None:
        """Flushes pending events and stops SSD I/O threads. Leases end."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for lease in list(self._leases.values()):
            self._end_lease(lease, "released")
        self.events.flush()
        if self.ssd is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.ssd.close)

    async def __aenter__(self) -> "BlockStore":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ queries

    def tier_of(self, key: bytes) -> str | None:
        """The fastest tier holding `key` (DRAM or SSD), or None."""
        if key in self.dram:
            return DRAM
        if self.ssd is not None and key in self.ssd:
            return SSD
        return None

    def exists(self, key: bytes) -> bool:
        """True if this node holds block `key` in any tier."""
        return self.tier_of(key) is not None

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's block keys, in order) are held, from the first
        up to the first miss. Touches nothing."""
        n = 0
        for key in keys:
            if self.tier_of(key) is None:
                break
            n += 1
        return n

    def location(self, key: bytes) -> Location | None:
        """(segment, offset, length) of `key` in the DRAM pool, or None. Without a
        lease the slot may be reused at any await: use `locate_many` for remote reads."""
        return self.dram.location(key)

    def inventory(self) -> Inventory:
        """Every key held, per tier, as of the last delivered event (pending events are
        flushed first)."""
        self.events.flush()
        tiers = {DRAM: self.dram.keys()}
        if self.ssd is not None:
            tiers[SSD] = self.ssd.keys()
        return Inventory(self.node_id, self.events.seq, tiers)

    def subscribe(self, maxsize: int = 10_000) -> asyncio.Queue:
        """A queue receiving `list[StoreEvent]` batches (see events.py)."""
        return self.events.subscribe(maxsize)

    def stats(self) -> dict:
        """Capacities, usage (bytes, blocks) and counters, as one flat dict."""
        out = {"block_bytes": self.block_bytes,
               "dram_capacity_bytes": self.dram.capacity_bytes,
               "dram_used_bytes": self.dram.used_bytes, "dram_blocks": len(self.dram),
               "ssd_capacity_bytes": self.ssd.capacity_bytes if self.ssd is not None else 0,
               "ssd_used_bytes": self.ssd.used_bytes if self.ssd is not None else 0,
               "ssd_blocks": len(self.ssd) if self.ssd is not None else 0,
               "ssd_error": self.ssd.error if self.ssd is not None else "",
               "pinned_blocks": len(self._pins), "leases": len(self._leases),
               "events_dropped": self.events.dropped}
        out.update(self.metrics.as_dict())
        return out

    # ------------------------------------------------------------------ pins and leases

    def _pin(self, key: bytes) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, key: bytes) -> None:
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
        else:
            del self._pins[key]

    def _can_evict(self, key: bytes) -> bool:
        return key not in self._pins

    def is_pinned(self, key: bytes) -> bool:
        """True while a pin or an unexpired lease holds `key`."""
        return key in self._pins

    def lease(self, keys: Iterable[bytes], ttl_s: float | None = None) -> Lease:
        """Pins the held blocks among `keys` until released or `ttl_s` seconds pass.

        Returns a Lease whose `keys` are those held now (absent keys are left out).
        While the lease holds, those blocks are neither evicted, demoted, moved nor
        removed, so their DRAM `location` stays valid.
        """
        ttl = self.settings.lease_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        held = tuple(k for k in keys if self.tier_of(k) is not None)
        return self._make_lease(held, ttl)

    def _make_lease(self, keys: tuple[bytes, ...], ttl: float) -> Lease:
        loop = asyncio.get_running_loop()
        lease = Lease(next(self._lease_ids), keys, loop.time() + ttl)
        for k in keys:
            self._pin(k)
        lease._timer = loop.call_at(lease.deadline, self._end_lease, lease, "expired")
        self._leases[lease.id] = lease
        return lease

    def _end_lease(self, lease: Lease, state: str) -> None:
        if lease.state != "held":
            return
        if lease._timer is not None:
            lease._timer.cancel()
        lease.state = state
        self._leases.pop(lease.id, None)
        for k in lease.keys:
            self._unpin(k)
        if state == "expired":
            self.metrics.lease_expired += 1
            log.warning("store_lease_expired", lease=lease.id, blocks=len(lease.keys))

    def lease_by_id(self, lease_id: int) -> Lease | None:
        """The held lease with this id, or None (released, expired or never made)."""
        return self._leases.get(lease_id)

    def check_lease(self, lease: Lease) -> None:
        """Raises LeaseExpired if the lease's deadline has passed (even if its timer has
        not fired yet, e.g. on a busy loop)."""
        if lease.state == "held" and asyncio.get_running_loop().time() >= lease.deadline:
            self._end_lease(lease, "expired")
        if lease.state == "expired":
            raise LeaseExpired(f"lease {lease.id} on {len(lease.keys)} blocks expired")

    def release(self, lease: Lease) -> None:
        """Ends a lease. Raises LeaseExpired if it ended by timeout first: bytes read
        under it must be discarded. Releasing twice is a no-op."""
        self.check_lease(lease)
        self._end_lease(lease, "released")

    # ------------------------------------------------------------------ eviction and tiering

    def _on_ssd_evict(self, keys: list[bytes]) -> None:
        self.metrics.evictions[SSD] += len(keys)
        for k in keys:
            self.events.emit(EVICTED, SSD, k)

    def _drop_dram(self, key: bytes) -> int:
        slot = self.dram.drop(key)
        self.metrics.evictions[DRAM] += 1
        self.events.emit(EVICTED, DRAM, key)
        return slot

    def _clean_dram_slot(self) -> int | None:
        """A DRAM slot without writing to SSD: a free one, or one whose block is
        already on SSD (dropped from DRAM). None if neither exists."""
        slot = self.dram.alloc()
        if slot is not None or self.ssd is None:
            return slot
        victim = self.dram.policy.victim(lambda k: self._can_evict(k) and k in self.ssd)
        return None if victim is None else self._drop_dram(victim)

    async def _dram_slots(self, n: int) -> list[int]:
        """Up to `n` DRAM slots for new blocks: free ones, then slots of the least
        recently used blocks, which are first demoted to SSD in one batch (or
        dropped without an SSD tier). Fewer than `n` when the rest are pinned."""
        slots: list[int] = []
        while len(slots) < n:
            slot = self.dram.alloc()
            if slot is None:
                break
            slots.append(slot)
        victims: list[bytes] = []
        while len(slots) + len(victims) < n:
            victim = self.dram.policy.victim(self._can_evict)
            if victim is None:
                break
            self._pin(victim)  # keeps its slot intact while the SSD write reads it
            victims.append(victim)
        try:
            dirty = [v for v in victims if self.ssd is not None and v not in self.ssd]
            if dirty:
                reasons = await self.ssd.write_many(
                    dirty, [self.dram.view(self.dram.slot_of(v)) for v in dirty])
                for v, reason in zip(dirty, reasons):
                    if reason:  # a cache may drop its least valuable block; counted
                        self.metrics.demote_failed += 1
                    else:
                        self.metrics.demotions += 1
                        self.events.emit(STORED, SSD, v)
        finally:
            for v in victims:
                self._unpin(v)
        for v in victims:
            if v in self.dram and self._can_evict(v):  # not removed or leased meanwhile
                slots.append(self._drop_dram(v))
        return slots

    # ------------------------------------------------------------------ put

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 1 <= len(key) <= ssd_mod.MAX_KEY_BYTES:
            raise ValueError(f"a block key is 1..{ssd_mod.MAX_KEY_BYTES} bytes, got {key!r:.40}")

    def _check_len(self, arr: np.ndarray) -> None:
        if arr.nbytes != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got a buffer of {arr.nbytes}")

    async def put(self, key: bytes, src: Any) -> PutResult:
        """Stores block `key` with the bytes of `src` (copied; `src` must not change
        until the put returns).

        Returns PutResult: STORED (with the tier), EXISTS (key already held or being
        stored: nothing written) or FAILED (with the reason: DRAM full of pinned
        blocks and no SSD, SSD full, ENOSPC, EACCES, ...). Never raises for a full
        store or an I/O error.
        Raises: ValueError for a bad key or a buffer that is not `block_bytes` long.
        """
        return (await self.put_many([key], [src]))[0]

    async def put_many(self, keys: Sequence[bytes], srcs: Sequence[Any]) -> list[PutResult]:
        """Stores blocks (e.g. a finished request's full blocks); one PutResult per key
        (see `put`). Blocks go to free DRAM slots at once; if DRAM is full, the least
        recently used blocks are demoted to SSD in one batch to make room, and what
        still does not fit goes to SSD directly. Then the keys are touched
        deepest-first, so eviction takes a prefix's tail before its head (a block is
        useless without its prefix).
        Raises: ValueError (before storing anything) for a bad key, a buffer that is
            not `block_bytes` long, or lengths that differ.
        """
        if len(keys) != len(srcs):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} buffers")
        arrs = []
        for key, src in zip(keys, srcs):
            self._check_key(key)
            arr = as_u8(src)
            self._check_len(arr)
            arrs.append(arr)
        results: list[PutResult | None] = [None] * len(keys)
        waits: list[tuple[int, asyncio.Future]] = []
        slow: list[int] = []
        seen: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            tier = self.tier_of(key)
            if tier is not None:
                self.metrics.put_exists += 1
                results[i] = PutResult(PutStatus.EXISTS, tier)
            elif key in self._inflight:
                waits.append((i, self._inflight[key]))
            elif key in seen:  # a duplicate within this batch
                waits.append((i, None))
            else:
                seen[key] = i
                slot = self.dram.alloc()  # fast path: no await, nothing can interleave
                if slot is not None:
                    results[i] = self._fill_slot(key, slot, arrs[i])
                else:
                    slow.append(i)
        if slow:
            loop = asyncio.get_running_loop()
            futs = {keys[i]: loop.create_future() for i in slow}
            self._inflight.update(futs)
            try:
                await self._put_slow(keys, arrs, slow, results)
            finally:
                for i in slow:
                    del self._inflight[keys[i]]
                    if results[i] is None:  # cancelled
                        results[i] = PutResult(PutStatus.FAILED, None, "cancelled")
                    futs[keys[i]].set_result(results[i])
        for i, fut in waits:
            first = results[seen[keys[i]]] if fut is None else await asyncio.shield(fut)
            if first.ok:
                self.metrics.put_exists += 1
                results[i] = PutResult(PutStatus.EXISTS, first.tier)
            else:
                results[i] = first
        self._touch_chain(keys)
        return results

    def _fill_slot(self, key: bytes, slot: int, arr: np.ndarray) -> PutResult:
        np.copyto(self.dram.view(slot), arr)
        self.dram.insert(key, slot)
        self.metrics.puts[DRAM] += 1
        self.events.emit(STORED, DRAM, key)
        return PutResult(PutStatus.STORED, DRAM)

    async def _put_slow(self, keys: Sequence[bytes], arrs: list[np.ndarray], idx: list[int],
                        results: list) -> None:
        slots = await self._dram_slots(len(idx))
        for i, slot in zip(idx, slots):
            results[i] = self._fill_slot(keys[i], slot, arrs[i])
        rest = idx[len(slots):]
        if not rest:
            return
        if self.ssd is None:
            reason = "DRAM pool full of pinned blocks" if self.dram.num_slots else \
                "no DRAM pool and no SSD tier"
            reasons = [reason] * len(rest)
        else:
            reasons = await self.ssd.write_many([keys[i] for i in rest], [arrs[i] for i in rest])
        for i, reason in zip(rest, reasons):
            if reason:
                self.metrics.put_failed += 1
                if self.ssd is not None:
                    self.metrics.io_errors += 1
                results[i] = PutResult(PutStatus.FAILED, None, reason)
            else:
                self.metrics.puts[SSD] += 1
                self.events.emit(STORED, SSD, keys[i])
                results[i] = PutResult(PutStatus.STORED, SSD)

    def _touch_chain(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.dram:
                self.dram.policy.touch(key)
            elif self.ssd is not None and key in self.ssd:
                self.ssd.touch(key)

    async def put_from(self, keys: Sequence[bytes],
                       fill: Callable[[list[bytes], list[np.ndarray]], Awaitable[list[str]]]
                       ) -> list[PutResult]:
        """Stores blocks whose bytes `fill` writes straight into reserved DRAM slots
        (e.g. a transfer-engine READ from a peer's pool: no bounce buffer).

        `fill(keys, views)` gets the keys not yet held and one writable
        [block_bytes] uint8 view per key, and returns one reason per key ("" when
        that view now holds the block). Only then are the blocks indexed; a block
        whose fill failed is not stored. Keys already held are EXISTS; keys that
        find no DRAM slot (all pinned) are FAILED.
        Raises: ValueError for a bad key; whatever `fill` raises (after freeing the
            slots and failing the blocks).
        """
        for key in keys:
            self._check_key(key)
        results: dict[bytes, PutResult] = {}
        waits = []
        todo = []
        for key in dict.fromkeys(keys):
            tier = self.tier_of(key)
            if tier is not None:
                self.metrics.put_exists += 1
                results[key] = PutResult(PutStatus.EXISTS, tier)
            elif key in self._inflight:
                waits.append((key, self._inflight[key]))
            else:
                todo.append(key)
        loop = asyncio.get_running_loop()
        futs = {k: loop.create_future() for k in todo}
        self._inflight.update(futs)
        slots: list[int] = []
        try:
            slots = await self._dram_slots(len(todo))
            for key in todo[len(slots):]:
                self.metrics.put_failed += 1
                results[key] = PutResult(PutStatus.FAILED, None, "DRAM pool full of pinned blocks"
                                         if self.dram.num_slots else "no DRAM pool")
            filled = todo[:len(slots)]
            reasons = await fill(filled, [self.dram.view(s) for s in slots]) if filled else []
            if len(reasons) != len(filled):
                raise RuntimeError(f"fill returned {len(reasons)} results for {len(filled)} blocks")
            for key, slot, reason in zip(filled, slots, reasons):
                if reason:
                    self.dram.free(slot)
                    self.metrics.put_failed += 1
                    results[key] = PutResult(PutStatus.FAILED, None, reason)
                else:
                    self.dram.insert(key, slot)
                    self.metrics.puts[DRAM] += 1
                    self.events.emit(STORED, DRAM, key)
                    results[key] = PutResult(PutStatus.STORED, DRAM)
            slots = []
        finally:
            for slot in slots:  # fill raised or was cancelled
                self.dram.free(slot)
            for key in todo:
                del self._inflight[key]
                res = results.setdefault(key, PutResult(PutStatus.FAILED, None, "fill failed"))
                futs[key].set_result(res)
        for key, fut in waits:
            first = await asyncio.shield(fut)
            if not first.ok:
                results[key] = first
            else:
                self.metrics.put_exists += 1
                results[key] = PutResult(PutStatus.EXISTS, first.tier)
        self._touch_chain(keys)
        return [results[k] for k in keys]

    # ------------------------------------------------------------------ get

    async def get_into(self, key: bytes, dst: Any, promote: bool | None = None) -> str | None:
        """Copies block `key` into `dst` (block_bytes, writable).

        Returns the tier it came from (DRAM or SSD) or None on a miss. A corrupt SSD
        block is a miss (counted in `metrics.corrupt`, logged, its slot freed): `dst`
        may then hold garbage and must not be used. An SSD hit is also copied into
        DRAM when `promote` (default `settings.promote_on_get`): at once if a slot can
        be had without writing another block to SSD, else by a background task that
        demotes the least recently used block first.
        Raises: ValueError for a bad key or buffer.
        """
        return (await self.get_many([key], [dst], promote))[0]

    async def get(self, key: bytes) -> bytes | None:
        """Block `key` as new bytes, or None on a miss (see `get_into`)."""
        buf = bytearray(self.block_bytes)
        return bytes(buf) if await self.get_into(key, buf) else None

    async def get_many(self, keys: Sequence[bytes], dsts: Sequence[Any],
                       promote: bool | None = None) -> list[str | None]:
        """`get_into` for many blocks: one tier (or None for a miss) per key. SSD reads
        are batched over the I/O threads. Touches the keys deepest-first (see
        `put_many`).
        Raises: ValueError for a bad key or buffer, or lengths that differ.
        """
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} buffers")
        outs = []
        for key, dst in zip(keys, dsts):
            self._check_key(key)
            out = as_u8(dst, writable=True)
            self._check_len(out)
            outs.append(out)
        results: list[str | None] = [None] * len(keys)
        on_ssd = []
        for i, key in enumerate(keys):
            slot = self.dram.slot_of(key)
            if slot is not None:
                np.copyto(outs[i], self.dram.view(slot))
                self.metrics.hits[DRAM] += 1
                results[i] = DRAM
            elif self.ssd is not None and key in self.ssd:
                on_ssd.append(i)
            else:
                self.metrics.misses += 1
        if on_ssd:
            promote = self.settings.promote_on_get if promote is None else promote
            got = await self._read_ssd([keys[i] for i in on_ssd], [outs[i] for i in on_ssd],
                                       promote)
            for i, ok in zip(on_ssd, got):
                results[i] = SSD if ok else None
        self._touch_chain(keys)
        return results

    async def _read_ssd(self, keys: list[bytes], outs: list[np.ndarray | None],
                        promote: bool) -> list[bool]:
        """Reads SSD blocks into `outs` (None: into a DRAM slot only), promoting into
        DRAM slots that cost no SSD write; True per block read and verified."""
        slots: list[int | None] = []
        for out in outs:
            # Stop asking once no clean slot is left (each ask scans the LRU order).
            want = promote and (not slots or slots[-1] is not None)
            slots.append(self._clean_dram_slot() if want or out is None else None)
        targets = [self.dram.view(s) if s is not None else o for s, o in zip(slots, outs)]
        todo = [i for i, t in enumerate(targets) if t is not None]
        for i in todo:
            self._pin(keys[i])
        try:
            outcomes = await self.ssd.read_many([keys[i] for i in todo],
                                                [memoryview(targets[i]) for i in todo])
        finally:
            for i in todo:
                self._unpin(keys[i])
        ok = [False] * len(keys)
        later: list[bytes] = []
        for i, (outcome, reason) in zip(todo, outcomes):
            key, out, slot = keys[i], outs[i], slots[i]
            if outcome != ssd_mod.OK:
                if slot is not None:
                    self.dram.free(slot)
                if outcome == ssd_mod.CORRUPT:
                    self.metrics.corrupt += 1
                elif outcome == ssd_mod.ERROR:
                    self.metrics.io_errors += 1
                    log.warning("ssd_read_failed", key=key.hex(), reason=reason)
                if key not in self.ssd:  # the tier dropped it (corrupt)
                    self.events.emit(EVICTED, SSD, key)
                self.metrics.misses += 1
                continue
            if slot is not None:
                if key in self.dram:  # promoted concurrently by another reader
                    self.dram.free(slot)
                    slot = self.dram.slot_of(key)
                else:
                    self.dram.insert(key, slot)
                    self.metrics.promotions += 1
                    self.events.emit(STORED, DRAM, key)
                if out is not None:
                    np.copyto(out, self.dram.view(slot))
            elif promote:
                later.append(key)
            self.metrics.hits[SSD] += 1
            ok[i] = True
        if later and len(self._background) < self.settings.ssd_io_threads:
            # No slot without an SSD write: promote in the background, off the read path.
            task = asyncio.get_running_loop().create_task(self._promote_many(later))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return ok

    async def _promote_many(self, keys: list[bytes]) -> None:
        """Brings SSD-only blocks into DRAM, demoting others if needed."""
        keys = [k for k in dict.fromkeys(keys) if k not in self.dram and self.ssd is not None
                and k in self.ssd]
        if not keys:
            return
        for k in keys:
            self._pin(k)
        try:
            slots = await self._dram_slots(len(keys))
        finally:
            for k in keys:
                self._unpin(k)
        for s in slots:
            self.dram.free(s)  # _read_ssd takes them again without an await in between
        todo = [k for k in keys[:len(slots)] if k not in self.dram and k in self.ssd]
        if todo:
            await self._read_ssd(todo, [None] * len(todo), promote=True)

    async def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Any]) -> int:
        """Loads the longest held prefix of `keys` into `dsts` (one buffer per key);
        returns n, the number of leading blocks loaded: dsts[:n] hold blocks keys[:n],
        the rest are untouched or garbage. What the engine calls on a prefix hit
        that misses its device pages."""
        n = self.longest_prefix(keys)
        got = await self.get_many(keys[:n], dsts[:n])
        for i, tier in enumerate(got):
            if tier is None:  # evicted or corrupt since longest_prefix
                return i
        return n

    # ------------------------------------------------------------------ remove

    async def remove(self, key: bytes) -> bool:
        """Deletes block `key` from every tier; True if it was held.
        Raises: BlockPinned if a reader holds a pin or lease on it."""
        if not self._can_evict(key) or key in self._inflight:
            raise BlockPinned(f"block {key.hex()} is pinned or being stored")
        held = False
        if key in self.dram:
            self.dram.free(self.dram.drop(key))
            self.events.emit(EVICTED, DRAM, key)
            held = True
        if self.ssd is not None and key in self.ssd:
            await self.ssd.remove(key)
            self.events.emit(EVICTED, SSD, key)
            held = True
        return held

    async def remove_many(self, keys: Iterable[bytes]) -> list[bool]:
        """`remove` for each key, in order (raises BlockPinned at the first pinned one)."""
        return [await self.remove(k) for k in keys]

    # ------------------------------------------------------------------ remote readers

    async def locate_many(self, keys: Sequence[bytes], ttl_s: float | None = None
                          ) -> tuple[list[Location | None], Lease]:
        """DRAM locations of `keys` for direct reads by a peer, under one lease.

        Blocks only on SSD are first read into DRAM (demoting others if needed).
        Returns (locations, lease): None for a key not held (or that could not be
        brought into DRAM); the lease pins every located block. The reader copies
        (segment, offset, length) through the transfer engine, then calls
        `release(lease)`; LeaseExpired there means the copy must be discarded.
        Raises: ValueError for a bad key or ttl.
        """
        for key in keys:
            self._check_key(key)
        ttl = self.settings.lease_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        if self.ssd is not None:
            await self._promote_many([k for k in keys if k not in self.dram and k in self.ssd])
        # No await from here on: the locations and the lease are taken atomically.
        locs = [self.dram.location(k) for k in keys]
        lease = self._make_lease(tuple(dict.fromkeys(k for k, loc in zip(keys, locs) if loc)), ttl)
        self._touch_chain(keys)
        return locs, lease


__all__ = ["BlockStore", "Lease", "as_u8", "StoreError", "LeaseExpired", "BlockPinned"]
