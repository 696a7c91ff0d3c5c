"""The local object API of the KV store: one node's DRAM pool and SSD tier (paper 3.2.1).

Objects are KV blocks of `block_bytes` bytes keyed by block keys; a key fixes
the bytes, so a put of a held key is a no-op ("exists"). A block lives in
DRAM, on SSD, or both; under pressure blocks move down, on use they move up
(tiering.py). Readers are protected by pins and by leases, pins with a
deadline for readers of the DRAM pool (leases.py). Every change of what a
tier holds is published as a batched `StoreEvent` (events.py) for the
conductor's global index; `inventory()` lists all keys.

`BlockStore` is the facade over those parts:
  - tiering.py `Tiers`: the DRAM pool and SSD tier (dram.py, ssd.py, both
    booked by a slots.py `SlotIndex`), demotion and promotion;
  - writes.py `BlockWriter`: puts, one writer per key;
  - leases.py `Pins`, `LeaseTable`;
  - events.py `EventBatcher`, types.py `StoreMetrics`.

All methods must be called from the event loop's thread. Buffers (`src`,
`dst`) are anything exposing the buffer protocol (bytes, bytearray,
memoryview, numpy arrays) or CPU torch tensors, C-contiguous, of exactly
`block_bytes` bytes (buffers.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mooncaked.config import Settings, StoreSettings, state_dir
from mooncaked.log import get_logger

from .buffers import as_u8, block_view, check_key
from .events import EventBatcher
from .leases import Lease, LeaseTable, Pins
from .tiering import Tiers
from .types import (DRAM, SSD, BlockPinned, Inventory, LeaseExpired, Location, PutResult,
                    StoreError, StoreMetrics)
from .writes import BlockWriter, Fill

log = get_logger(__name__)


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
        ValueError: block_bytes < 1, an unknown eviction policy, or an SSD tier
            without a directory.
    Use `await start()` first and `await close()` at the end (or `async with`).
    """

    def __init__(self, block_bytes: int, settings: StoreSettings | None = None, *,
                 node_id: str = "local", ssd_dir: str | None = None, segment: str | None = None):
        self.settings = s = settings or StoreSettings()
        self.block_bytes = block_bytes
        self.node_id = node_id
        self.events = EventBatcher(node_id, s.event_interval_ms / 1000.0, s.event_max_keys)
        self.metrics = StoreMetrics()
        self.pins = Pins()
        self.leases = LeaseTable(self.pins, s.lease_ttl_s, self._on_lease_expired)
        self.tiers = Tiers(block_bytes, s, segment or f"{node_id}/kv-dram", ssd_dir or s.ssd_dir,
                           self.pins, self.events, self.metrics)
        self.dram = self.tiers.dram
        self.ssd = self.tiers.ssd
        self.writer = BlockWriter(self.tiers, block_bytes)

    @classmethod
    def from_settings(cls, settings: Settings, block_bytes: int, node_id: str) -> "BlockStore":
        """A store from the full settings: resolves an empty `store.ssd_dir` to
        `<config.state_dir(settings)>/kvstore` (node.state_dir, $STATE_DIRECTORY or
        ~/.local/state/mooncaked).
        Raises: what the constructor raises."""
        directory = settings.store.ssd_dir
        if not directory:
            directory = str(state_dir(settings) / "kvstore")
        return cls(block_bytes, settings.store, node_id=node_id, ssd_dir=directory)

    def _on_lease_expired(self, lease: Lease) -> None:
        self.metrics.lease_expired += 1

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "BlockStore":
        """Opens the SSD tier (indexing the blocks a previous run left there).
        Raises: StoreError if another process holds the SSD directory."""
        if self.ssd is not None:
            await self.ssd.open()
        log.info("store_started", node=self.node_id, block_bytes=self.block_bytes,
                 dram_slots=self.dram.num_slots,
                 ssd_blocks=len(self.ssd) if self.ssd is not None else 0)
        return self

    async def close(self) -> None:
        """Writes DRAM blocks the SSD tier lacks to it (a clean stop persists them),
        flushes pending events and stops SSD I/O threads. Leases end."""
        await self.tiers.close()
        self.leases.release_all()
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
        return self.tiers.tier_of(key)

    def exists(self, key: bytes) -> bool:
        """True if this node holds block `key` in any tier."""
        return self.tiers.tier_of(key) is not None

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's block keys, in order) are held, from the first
        up to the first miss (blocks). Touches nothing."""
        n = 0
        for key in keys:
            if self.tiers.tier_of(key) is None:
                break
            n += 1
        return n

    def location(self, key: bytes) -> Location | None:
        """(segment, offset, length) of `key` in the DRAM pool (bytes), or None. Without a
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
        """A queue receiving `list[StoreEvent]` batches (see events.py); `maxsize` batches."""
        return self.events.subscribe(maxsize)

    def stats(self) -> dict:
        """Capacities and usage (bytes, blocks) and counters, as one flat dict."""
        ssd = self.ssd
        out = {"block_bytes": self.block_bytes,
               "dram_capacity_bytes": self.dram.capacity_bytes,
               "dram_used_bytes": self.dram.used_bytes, "dram_blocks": len(self.dram),
               "ssd_capacity_bytes": ssd.capacity_bytes if ssd is not None else 0,
               "ssd_used_bytes": ssd.used_bytes if ssd is not None else 0,
               "ssd_blocks": len(ssd) if ssd is not None else 0,
               "ssd_error": ssd.error if ssd is not None else "",
               "pinned_blocks": len(self.pins), "leases": len(self.leases),
               "events_dropped": self.events.dropped}
        out.update(self.metrics.as_dict())
        return out

    # ------------------------------------------------------------------ pins and leases

    def is_pinned(self, key: bytes) -> bool:
        """True while a pin or an unexpired lease holds `key`."""
        return key in self.pins

    def lease(self, keys: Iterable[bytes], ttl_s: float | None = None) -> Lease:
        """Pins the held blocks among `keys` until released or `ttl_s` seconds pass
        (default `settings.lease_ttl_s`).

        Returns a Lease whose `keys` are those held now (absent keys are left out).
        While the lease holds, those blocks are neither evicted, demoted, moved nor
        removed, so their DRAM `location` stays valid.
        Raises: ValueError for a ttl that is not > 0.
        """
        ttl = self.leases.ttl(ttl_s)
        return self.leases.grant([k for k in keys if self.tiers.tier_of(k) is not None], ttl)

    def lease_by_id(self, lease_id: int) -> Lease | None:
        """The held lease with this id, or None (released, expired or never made)."""
        return self.leases.get(lease_id)

    def check_lease(self, lease: Lease) -> None:
        """Raises LeaseExpired if the lease's deadline has passed (even if its timer has
        not fired yet, e.g. on a busy loop)."""
        self.leases.check(lease)

    def release(self, lease: Lease) -> None:
        """Ends a lease. Raises LeaseExpired if it ended by timeout first: bytes read
        under it must be discarded. Releasing twice is a no-op."""
        self.leases.release(lease)

    # ------------------------------------------------------------------ put

    async def put(self, key: bytes, src: Any) -> PutResult:
        """Stores block `key` with the bytes of `src` (copied; `src` must not change
        until the put returns).

        Returns PutResult: STORED (with the tier), EXISTS (key already held or being
        stored: nothing written) or FAILED (with the reason: a capacity shortage
        starts with types.NO_ROOM; else ENOSPC, EACCES, ...). Never raises for a full
        store or an I/O error. With an SSD tier the block is also written through to
        it in the background (tiering.py: the durability contract).
        Raises: ValueError for a bad key or a buffer that is not `block_bytes` long.
        """
        return (await self.writer.put_many([key], [src]))[0]

    async def put_many(self, keys: Sequence[bytes], srcs: Sequence[Any]) -> list[PutResult]:
        """Stores blocks (e.g. a finished request's full blocks); one PutResult per key
        (see `put`). Blocks go to free DRAM slots at once; if DRAM is full, the least
        recently used blocks are demoted to SSD in one batch to make room, and what
        still does not fit goes to SSD directly. The batch never evicts its own keys:
        what finds no room fails (NO_ROOM), and each result is true after the call;
        the blocks that fit are the first ones (a prefix's head). Then the keys are touched
        deepest-first, so eviction takes a prefix's tail before its head (a block is
        useless without its prefix).
        Raises: ValueError (before storing anything) for a bad key, a buffer that is
            not `block_bytes` long, or lengths that differ.
        """
        return await self.writer.put_many(keys, srcs)

    async def put_from(self, keys: Sequence[bytes], fill: Fill) -> list[PutResult]:
        """Stores blocks whose bytes `fill` writes straight into reserved DRAM slots
        (e.g. a transfer-engine READ from a peer's pool: no bounce buffer).

        `fill(keys, views)` gets the keys not yet held and one writable
        [block_bytes] uint8 view per key, and returns one reason per key ("" when
        that view now holds the block). Only then are the blocks indexed; a block
        whose fill failed is not stored. Keys already held are EXISTS; keys that
        find no DRAM slot are FAILED (NO_ROOM).
        Raises: ValueError for a bad key; RuntimeError if `fill` returns a wrong
            number of reasons; whatever `fill` raises (after freeing the slots and
            failing the blocks).
        """
        return await self.writer.put_from(keys, fill)

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
        """Block `key` as new bytes (block_bytes long), or None on a miss (see `get_into`).
        Raises: ValueError for a bad key."""
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
            check_key(key)
            outs.append(block_view(dst, self.block_bytes, writable=True))
        results: list[str | None] = [None] * len(keys)
        on_ssd = []
        dram, ssd, metrics = self.dram, self.ssd, self.metrics
        for i, key in enumerate(keys):
            slot = dram.index.slot_of(key)
            if slot is not None:
                np.copyto(outs[i], dram.view(slot))
                metrics.hits[DRAM] += 1
                results[i] = DRAM
            elif ssd is not None and key in ssd:
                on_ssd.append(i)
            else:
                metrics.misses += 1
        if on_ssd:
            promote = self.settings.promote_on_get if promote is None else promote
            got = await self.tiers.read_ssd([keys[i] for i in on_ssd], [outs[i] for i in on_ssd],
                                            promote)
            for i, ok in zip(on_ssd, got):
                results[i] = SSD if ok else None
        self.tiers.touch_chain(keys)
        return results

    async def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Any]) -> int:
        """Loads the longest held prefix of `keys` into `dsts` (one buffer per key);
        returns n, the number of leading blocks loaded: dsts[:n] hold blocks keys[:n],
        the rest are untouched or garbage. What the engine calls on a prefix hit
        that misses its device pages.
        Raises: ValueError for a bad key or buffer."""
        n = self.longest_prefix(keys)
        got = await self.get_many(keys[:n], dsts[:n])
        for i, tier in enumerate(got):
            if tier is None:  # evicted or corrupt since longest_prefix
                return i
        return n

    # ------------------------------------------------------------------ remove

    async def remove(self, key: bytes) -> bool:
        """Deletes block `key` from every tier; True if it was held.
        Raises: BlockPinned if a reader holds a pin or lease on it, or it is being stored."""
        if key in self.pins or key in self.writer:
            raise BlockPinned(f"block {key.hex()} is pinned or being stored")
        return await self.tiers.remove(key)

    async def remove_many(self, keys: Iterable[bytes]) -> list[bool]:
        """`remove` for each key, in order (raises BlockPinned at the first pinned one)."""
        return [await self.remove(k) for k in keys]

    # ------------------------------------------------------------------ remote readers

    async def locate_many(self, keys: Sequence[bytes], ttl_s: float | None = None
                          ) -> tuple[list[Location | None], Lease]:
        """DRAM locations of `keys` for direct reads by a peer, under one lease.

        Blocks only on SSD are first read into DRAM (demoting others if needed).
        Returns (locations, lease): None for a key not held (or that could not be
        brought into DRAM); the lease pins every located block for `ttl_s` seconds
        (default `settings.lease_ttl_s`). The reader copies (segment, offset, length)
        through the transfer engine, then calls `release(lease)`; LeaseExpired there
        means the copy must be discarded.
        Raises: ValueError for a bad key or ttl.
        """
        for key in keys:
            check_key(key)
        ttl = self.leases.ttl(ttl_s)
        if self.ssd is not None:
            await self.tiers.promote_many(self.tiers.only_on_ssd(keys))
        # No await from here on: the locations and the lease are taken atomically.
        locs = [self.dram.location(k) for k in keys]
        lease = self.leases.grant(dict.fromkeys(k for k, loc in zip(keys, locs) if loc), ttl)
        self.tiers.touch_chain(keys)
        return locs, lease


__all__ = ["BlockStore", "Lease", "as_u8", "StoreError", "LeaseExpired", "BlockPinned"]
