"""The store's tiers and the moves between them (paper section 3.2.1).

A block lives in the DRAM pool, on the SSD tier, or both (after a promotion
the SSD copy is kept, so demoting it again costs nothing). Under pressure
blocks move down: to free DRAM slots the policy's victims are demoted to SSD
in one batched write (or dropped when there is no SSD tier). On use they move
up: an SSD hit is copied into a DRAM slot (promotion), at once when a slot
can be had without writing another block to SSD, else by a background task.

Durability (with an SSD tier): write-through, asynchronously. Every block put
into DRAM is queued and written to the SSD tier by a background flush, in put
order, which is a prefix's head before its tail (ssd.py commits a batch's
headers in order), and before any block of a later put reaches the SSD (a put
that overflows DRAM or a demotion flushes the queue first). So after a crash
the SSD holds the blocks of earlier puts and a head of the last ones: the head
of a prefix is never less durable than its tail. A clean close flushes every
DRAM block the SSD does not hold yet. The SSD tier thus holds a superset of
DRAM (capacity permitting) and demotion is a drop; a block whose SSD copy was
evicted is written again when it is demoted.

Pinned or leased blocks (leases.py) are never chosen; every change of what a
tier holds is published as an event (events.py) and counted (StoreMetrics).
Event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from mooncaked.config import StoreSettings
from mooncaked.log import get_logger

from . import ssd as ssd_mod
from .dram import DramPool
from .events import EVICTED, STORED, EventBatcher
from .leases import Pins
from .ssd import SsdTier
from .types import DRAM, NO_ROOM, SSD, StoreMetrics

log = get_logger(__name__)

FLUSH_BATCH = 64  # blocks per write-through batch: one SSD write_many (amortises the thread hops)


class Tiers:
    """A node's DRAM pool over an optional SSD tier, and the moves between them.

    Args:
        block_bytes: bytes of one block (>= 1).
        settings: the `[store]` section (dram_bytes, ssd_bytes, eviction, ssd_fsync,
            ssd_io_threads).
        segment: transfer-engine segment name of the DRAM pool.
        ssd_dir: directory of the SSD tier; required when `settings.ssd_bytes > 0`.
        pins: the store's pins (pinned blocks are never evicted or demoted).
        events, metrics: where changes are published and counted.
    Attributes: `dram` (DramPool), `ssd` (SsdTier or None), `background` (running
    background promotions, at most `settings.ssd_io_threads`).
    Raises:
        ValueError: block_bytes < 1, an unknown policy, or an SSD tier without a directory.
    """

    def __init__(self, block_bytes: int, settings: StoreSettings, segment: str,
                 ssd_dir: str | None, pins: Pins, events: EventBatcher, metrics: StoreMetrics):
        self.pins, self.events, self.metrics = pins, events, metrics
        self.dram = DramPool(settings.dram_bytes, block_bytes, segment, settings.eviction)
        self.ssd: SsdTier | None = None
        if settings.ssd_bytes > 0:
            if not ssd_dir:
                raise ValueError("store.ssd_bytes > 0 needs store.ssd_dir (or ssd_dir=...)")
            self.ssd = SsdTier(ssd_dir, settings.ssd_bytes, block_bytes, pins.can_evict,
                               self._on_ssd_evict, settings.eviction, settings.ssd_fsync,
                               settings.ssd_io_threads)
        self.max_background = settings.ssd_io_threads
        self.background: set[asyncio.Task] = set()  # promotions that needed a demotion
        self._dirty: dict[bytes, None] = {}  # DRAM blocks to write through, in put order
        self._flusher: asyncio.Task | None = None
        self._flush_lock = asyncio.Lock()

    async def close(self) -> None:
        """Cancels background promotions, then writes every DRAM block the SSD tier does
        not hold yet (a clean stop loses nothing the SSD could keep)."""
        for task in list(self.background):
            task.cancel()
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
        if self.ssd is not None and not self.ssd.error:
            self._dirty.update((k, None) for k in self.dram.keys() if k not in self.ssd)
            await self.flush()
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)

    # ------------------------------------------------------------------ write-through

    def shortage(self, own: set[bytes]) -> str:
        """The reason of a put of the batch `own` (its keys) that found no room: a
        capacity shortage (types.NO_ROOM), naming the tier and what fills it."""
        tier = self.dram if self.ssd is None else self.ssd
        name = "DRAM pool" if self.ssd is None else "SSD tier"
        if not tier.num_slots:
            return f"{NO_ROOM}: no DRAM pool and no SSD tier" if self.ssd is None else \
                f"{NO_ROOM}: the SSD tier has no slots"
        held = tier.keys()
        mine = sum(1 for k in held if k in own)
        readers = sum(1 for k in held if k not in own and k in self.pins)
        more = " and no SSD tier" if self.ssd is None else ""
        return (f"{NO_ROOM}: {name} full ({tier.num_slots} slots: {mine} hold this batch's "
                f"blocks, {readers} are pinned by readers){more}")

    def mark_dirty(self, keys: Sequence[bytes]) -> None:
        """Queues blocks just put into DRAM (in order) for the SSD tier and starts the
        background flush. No-op without a writable SSD tier."""
        if self.ssd is None or self.ssd.error:
            return
        for k in keys:
            self._dirty[k] = None
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self.flush())

    @property
    def flushing(self) -> bool:
        """True while the background write-through task runs (its slots are reserved)."""
        return self._flusher is not None and not self._flusher.done()

    @property
    def dirty(self) -> int:
        """DRAM blocks queued for the SSD tier and not written yet (blocks)."""
        return len(self._dirty)

    async def flush(self) -> int:
        """Writes the queued DRAM blocks to the SSD tier in queue order, FLUSH_BATCH at a
        time (each pinned meanwhile); returns how many were written. A block removed or
        evicted from DRAM meanwhile is skipped; a failed write is counted and logged by
        the tier (the block stays in DRAM)."""
        written = 0
        async with self._flush_lock:
            while self._dirty and self.ssd is not None:
                batch: list[bytes] = []
                while self._dirty and len(batch) < FLUSH_BATCH:
                    key = next(iter(self._dirty))
                    del self._dirty[key]
                    if key in self.dram and key not in self.ssd:
                        batch.append(key)
                if not batch:
                    continue
                index = self.dram.index
                for k in batch:
                    self.pins.pin(k)
                try:
                    reasons = await self.ssd.write_many(
                        batch, [self.dram.view(index.slot_of(k)) for k in batch])
                finally:
                    for k in batch:
                        self.pins.unpin(k)
                for k, reason in zip(batch, reasons):
                    if reason:
                        self.metrics.persist_failed += 1
                    else:
                        written += 1
                        self.metrics.persisted += 1
                        self.events.emit(STORED, SSD, k)
                # Newest use last: the head of each prefix is the last the SSD evicts.
                for k in reversed(batch):
                    if k in self.ssd:
                        self.ssd.touch(k)
        return written

    # ------------------------------------------------------------------ queries and uses

    def tier_of(self, key: bytes) -> str | None:
        """The fastest tier holding `key` (DRAM or SSD), or None."""
        if key in self.dram:
            return DRAM
        if self.ssd is not None and key in self.ssd:
            return SSD
        return None

    def only_on_ssd(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys held on SSD but not in DRAM, in order."""
        if self.ssd is None:
            return []
        return [k for k in keys if k not in self.dram and k in self.ssd]

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Records a use of each held key, deepest-first (last key first), so eviction
        takes a prefix's tail before its head (a block is useless without its prefix)."""
        for key in reversed(keys):
            if key in self.dram:
                self.dram.touch(key)
            elif self.ssd is not None and key in self.ssd:
                self.ssd.touch(key)

    def add_to_dram(self, key: bytes, slot: int) -> None:
        """Indexes the reserved DRAM `slot`, whose bytes now hold block `key` (a put):
        counted, published and queued for the SSD tier."""
        self.dram.index.insert(key, slot)
        self.metrics.puts[DRAM] += 1
        self.events.emit(STORED, DRAM, key)
        self.mark_dirty((key,))

    async def remove(self, key: bytes) -> bool:
        """Deletes block `key` from every tier, publishing the evictions; True if it was
        held. The caller checks pins first."""
        held = False
        if key in self.dram:
            self.dram.index.free(self.dram.index.drop(key))
            self.events.emit(EVICTED, DRAM, key)
            held = True
        if self.ssd is not None and key in self.ssd:
            await self.ssd.remove(key)
            self.events.emit(EVICTED, SSD, key)
            held = True
        return held

    # ------------------------------------------------------------------ down: demotion

    def _on_ssd_evict(self, keys: list[bytes]) -> None:
        self.metrics.evictions[SSD] += len(keys)
        for k in keys:
            self.events.emit(EVICTED, SSD, k)

    def _drop_dram(self, key: bytes) -> int:
        slot = self.dram.index.drop(key)
        self.metrics.evictions[DRAM] += 1
        self.events.emit(EVICTED, DRAM, key)
        return slot

    def clean_dram_slot(self) -> int | None:
        """A DRAM slot without writing to SSD: a free one, or one whose block is
        already on SSD (dropped from DRAM). None if neither exists."""
        slot = self.dram.index.alloc()
        if slot is not None or self.ssd is None:
            return slot
        victim = self.dram.index.victim(lambda k: self.pins.can_evict(k) and k in self.ssd)
        return None if victim is None else self._drop_dram(victim)

    async def dram_slots(self, n: int) -> list[int]:
        """Up to `n` reserved DRAM slots for new blocks: free ones, then slots of the
        policy's victims, which are first demoted to SSD in one batch (or dropped
        without an SSD tier). Fewer than `n` when the rest are pinned. The
        write-through queue is flushed first, so no block reaches the SSD tier before
        the blocks put earlier."""
        index = self.dram.index
        if self._dirty and index.free_slots < n:
            await self.flush()
        slots: list[int] = []
        while len(slots) < n:
            slot = index.alloc()
            if slot is None:
                break
            slots.append(slot)
        victims: list[bytes] = []
        while len(slots) + len(victims) < n:
            victim = index.victim(self.pins.can_evict)
            if victim is None:
                break
            self.pins.pin(victim)  # keeps its slot intact while the SSD write reads it
            victims.append(victim)
        try:
            dirty = [v for v in victims if self.ssd is not None and v not in self.ssd]
            if dirty:
                reasons = await self.ssd.write_many(
                    dirty, [self.dram.view(index.slot_of(v)) for v in dirty])
                for v, reason in zip(dirty, reasons):
                    if reason:  # a cache may drop its least valuable block; counted
                        self.metrics.demote_failed += 1
                    else:
                        self.metrics.demotions += 1
                        self.events.emit(STORED, SSD, v)
        finally:
            for v in victims:
                self.pins.unpin(v)
        for v in victims:
            if v in index and self.pins.can_evict(v):  # not removed or leased meanwhile
                slots.append(self._drop_dram(v))
        return slots

    # ------------------------------------------------------------------ up: reads and promotion

    async def read_ssd(self, keys: list[bytes], outs: list[np.ndarray | None],
                       promote: bool) -> list[bool]:
        """Reads SSD blocks into `outs` (None: into a DRAM slot only), promoting into
        DRAM slots that cost no SSD write (the rest in the background when `promote`);
        True per block read and verified. A corrupt or unreadable block is a miss
        (counted, its event published); its `outs` entry may then hold garbage."""
        index = self.dram.index
        slots: list[int | None] = []
        for out in outs:
            # Stop asking once no clean slot is left (each ask scans the eviction order).
            want = promote and (not slots or slots[-1] is not None)
            slots.append(self.clean_dram_slot() if want or out is None else None)
        targets = [self.dram.view(s) if s is not None else o for s, o in zip(slots, outs)]
        todo = [i for i, t in enumerate(targets) if t is not None]
        for i in todo:
            self.pins.pin(keys[i])
        try:
            outcomes = await self.ssd.read_many([keys[i] for i in todo],
                                                [memoryview(targets[i]) for i in todo])
        finally:
            for i in todo:
                self.pins.unpin(keys[i])
        ok = [False] * len(keys)
        later: list[bytes] = []
        for i, (outcome, reason) in zip(todo, outcomes):
            key, out, slot = keys[i], outs[i], slots[i]
            if outcome != ssd_mod.OK:
                if slot is not None:
                    index.free(slot)
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
                if key in index:  # promoted concurrently by another reader
                    index.free(slot)
                    slot = index.slot_of(key)
                else:
                    index.insert(key, slot)
                    self.metrics.promotions += 1
                    self.events.emit(STORED, DRAM, key)
                if out is not None:
                    np.copyto(out, self.dram.view(slot))
            elif promote:
                later.append(key)
            self.metrics.hits[SSD] += 1
            ok[i] = True
        if later and len(self.background) < self.max_background:
            # No slot without an SSD write: promote in the background, off the read path.
            task = asyncio.get_running_loop().create_task(self.promote_many(later))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
        return ok

    async def promote_many(self, keys: list[bytes]) -> None:
        """Brings SSD-only blocks among `keys` into DRAM, demoting others if needed."""
        keys = self.only_on_ssd(list(dict.fromkeys(keys)))
        if not keys:
            return
        for k in keys:
            self.pins.pin(k)
        try:
            slots = await self.dram_slots(len(keys))
        finally:
            for k in keys:
                self.pins.unpin(k)
        for s in slots:
            self.dram.index.free(s)  # read_ssd takes them again without an await in between
        todo = [k for k in keys[:len(slots)] if k not in self.dram and k in self.ssd]
        if todo:
            await self.read_ssd(todo, [None] * len(todo), promote=True)
