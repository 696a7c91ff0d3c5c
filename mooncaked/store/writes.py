"""Storing new blocks: admission into the tiers, one writer per key.

Objects are immutable, so a put of a held key is a no-op (EXISTS), and
concurrent puts of one key (several requests finishing the same prefix, or a
duplicate within one batch) write it once: the first registers an in-flight
future, the others wait for its result. A block goes to a free DRAM slot at
once (no await on this fast path); when DRAM is full, the policy's victims
are demoted to SSD in one batch to make room (tiering.py), and what still
does not fit is written to SSD directly. `put_from` lets the caller fill
reserved DRAM slots in place (a transfer-engine READ from a peer's pool).

A batch never evicts its own blocks to make room for itself: while it waits
for room, every key of the batch is pinned, so what does not fit fails with a
`NO_ROOM` reason and every result says what the store holds after the call.
The blocks that fit are the batch's first ones (a prefix's head).

Event loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from .buffers import block_view, check_key
from .events import STORED
from .tiering import Tiers
from .types import DRAM, NO_ROOM, SSD, PutResult, PutStatus

Fill = Callable[[list[bytes], list[np.ndarray]], Awaitable[list[str]]]
"""`fill(keys, views)`: writes block keys[i] into views[i] ([block_bytes] uint8, writable);
returns one reason per key ("" when that view now holds the block)."""


class BlockWriter:
    """Puts blocks into `tiers`, writing each key once however many callers put it.

    Args:
        tiers: the store's tiers (their events and metrics record each put).
        block_bytes: bytes of one block; every source buffer must be that long.
    """

    def __init__(self, tiers: Tiers, block_bytes: int):
        self.tiers = tiers
        self.block_bytes = block_bytes
        self._inflight: dict[bytes, asyncio.Future] = {}

    def __contains__(self, key: bytes) -> bool:
        """True while block `key` is being stored (not yet indexed)."""
        return key in self._inflight

    def _exists(self, tier: str | None) -> PutResult:
        self.tiers.metrics.put_exists += 1
        return PutResult(PutStatus.EXISTS, tier)

    async def put_many(self, keys: Sequence[bytes], srcs: Sequence[Any]) -> list[PutResult]:
        """Stores blocks; one PutResult per key: STORED (with the tier), EXISTS (held or
        being stored: nothing written) or FAILED (with the reason). Touches the keys
        deepest-first at the end. Never raises for a full store or an I/O error.
        Raises: ValueError (before storing anything) for a bad key, a buffer that is
            not `block_bytes` long, or lengths that differ.
        """
        if len(keys) != len(srcs):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} buffers")
        arrs = []
        for key, src in zip(keys, srcs):
            check_key(key)
            arrs.append(block_view(src, self.block_bytes))
        tiers, alloc = self.tiers, self.tiers.dram.index.alloc
        results: list[PutResult | None] = [None] * len(keys)
        waits: list[tuple[int, asyncio.Future | None]] = []
        slow: list[int] = []
        seen: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            tier = tiers.tier_of(key)
            if tier is not None:
                results[i] = self._exists(tier)
            elif key in self._inflight:
                waits.append((i, self._inflight[key]))
            elif key in seen:  # a duplicate within this batch
                waits.append((i, None))
            else:
                seen[key] = i
                slot = alloc()  # fast path: no await, nothing can interleave
                if slot is not None:
                    results[i] = self._fill_slot(key, slot, arrs[i])
                else:
                    slow.append(i)
        if slow:
            loop = asyncio.get_running_loop()
            futs = {keys[i]: loop.create_future() for i in slow}
            self._inflight.update(futs)
            own = list(seen) + [k for k, r in zip(keys, results) if r is not None and r.ok]
            for k in own:  # the batch never makes room by evicting itself
                tiers.pins.pin(k)
            try:
                await self._put_slow(keys, arrs, slow, results)
            finally:
                for k in own:
                    tiers.pins.unpin(k)
                for i in slow:
                    del self._inflight[keys[i]]
                    if results[i] is None:  # cancelled
                        results[i] = PutResult(PutStatus.FAILED, None, "cancelled")
                    futs[keys[i]].set_result(results[i])
        for i, fut in waits:
            first = results[seen[keys[i]]] if fut is None else await asyncio.shield(fut)
            results[i] = self._exists(first.tier) if first.ok else first
        tiers.touch_chain(keys)
        return results

    def _fill_slot(self, key: bytes, slot: int, arr: np.ndarray) -> PutResult:
        np.copyto(self.tiers.dram.view(slot), arr)
        self.tiers.add_to_dram(key, slot)
        return PutResult(PutStatus.STORED, DRAM)

    async def _put_slow(self, keys: Sequence[bytes], arrs: list[np.ndarray], idx: list[int],
                        results: list) -> None:
        """Stores keys[i] for i in `idx` when no DRAM slot was free: into slots freed by
        demotion, then straight to SSD."""
        tiers, metrics = self.tiers, self.tiers.metrics
        slots = await tiers.dram_slots(len(idx))
        for i, slot in zip(idx, slots):
            results[i] = self._fill_slot(keys[i], slot, arrs[i])
        rest = idx[len(slots):]
        if not rest:
            return
        if tiers.ssd is None:
            reasons = [tiers.shortage(set(keys))] * len(rest)
        else:
            await tiers.flush()  # the blocks put before these reach the SSD first
            reasons = await tiers.ssd.write_many([keys[i] for i in rest], [arrs[i] for i in rest])
        for i, reason in zip(rest, reasons):
            if reason:
                metrics.put_failed += 1
                if not reason.startswith(NO_ROOM):
                    metrics.io_errors += 1
                results[i] = PutResult(PutStatus.FAILED, None, reason)
            else:
                metrics.puts[SSD] += 1
                tiers.events.emit(STORED, SSD, keys[i])
                results[i] = PutResult(PutStatus.STORED, SSD)

    async def put_from(self, keys: Sequence[bytes], fill: Fill) -> list[PutResult]:
        """Stores blocks whose bytes `fill` writes straight into reserved DRAM slots.

        `fill` gets the keys not yet held or being stored, and one view per key; only
        the blocks it reports filled are indexed (STORED in DRAM). Keys already held
        are EXISTS; keys that find no DRAM slot (all pinned) or whose fill failed are
        FAILED (NO_ROOM). Touches the keys deepest-first at the end.
        Raises: ValueError for a bad key; RuntimeError if `fill` returns a wrong number
            of reasons; whatever `fill` raises (after freeing the slots and failing
            the blocks).
        """
        for key in keys:
            check_key(key)
        tiers, metrics = self.tiers, self.tiers.metrics
        index = tiers.dram.index
        results: dict[bytes, PutResult] = {}
        waits = []
        todo = []
        for key in dict.fromkeys(keys):
            tier = tiers.tier_of(key)
            if tier is not None:
                results[key] = self._exists(tier)
            elif key in self._inflight:
                waits.append((key, self._inflight[key]))
            else:
                todo.append(key)
        loop = asyncio.get_running_loop()
        futs = {k: loop.create_future() for k in todo}
        self._inflight.update(futs)
        slots: list[int] = []
        own = list(dict.fromkeys(keys))
        try:
            for k in own:  # the batch never makes room by evicting itself
                tiers.pins.pin(k)
            try:
                slots = await tiers.dram_slots(len(todo))
            finally:
                for k in own:
                    tiers.pins.unpin(k)
            for key in todo[len(slots):]:
                metrics.put_failed += 1
                results[key] = PutResult(PutStatus.FAILED, None, tiers.shortage(set(own)))
            filled = todo[:len(slots)]
            reasons = await fill(filled, [tiers.dram.view(s) for s in slots]) if filled else []
            if len(reasons) != len(filled):
                raise RuntimeError(f"fill returned {len(reasons)} results for {len(filled)} blocks")
            for key, slot, reason in zip(filled, slots, reasons):
                if reason:
                    index.free(slot)
                    metrics.put_failed += 1
                    results[key] = PutResult(PutStatus.FAILED, None, reason)
                else:
                    tiers.add_to_dram(key, slot)
                    results[key] = PutResult(PutStatus.STORED, DRAM)
            slots = []
        finally:
            for slot in slots:  # fill raised or was cancelled
                index.free(slot)
            for key in todo:
                del self._inflight[key]
                res = results.setdefault(key, PutResult(PutStatus.FAILED, None, "fill failed"))
                futs[key].set_result(res)
        for key, fut in waits:
            first = await asyncio.shield(fut)
            results[key] = self._exists(first.tier) if first.ok else first
        tiers.touch_chain(keys)
        return [results[k] for k in keys]
