"""The DRAM tier: one preallocated pool of fixed-size slots per node (paper section 3.2.1).

The pool is a single uint8 buffer of `num_slots * block_bytes` bytes. Slot i
holds one KV block at byte offset `i * block_bytes`, so the whole pool can be
registered with the transfer engine as one segment and a peer reads block K
directly at `location(K) = (segment, offset, block_bytes)`.

This class only owns the bytes; which slot holds which key, the free slots and
the eviction order are its `index` (slots.py, the same books the SSD tier
keeps). Pins, leases, demotion to SSD and events live in the store (store.py,
tiering.py), which calls it from the event loop thread only.
"""

from __future__ import annotations

import numpy as np

from .slots import SlotIndex, SlotTier
from .types import Location


class DramPool(SlotTier):
    """Fixed-size slots in one preallocated buffer, keyed by block key.

    Args:
        capacity_bytes: bytes lent to the pool; `capacity_bytes // block_bytes` slots.
        block_bytes: bytes of one block (all blocks of one model have this size).
        segment: name under which the pool is (or will be) registered with the
            transfer engine; it appears in every `Location`.
        policy: eviction policy name ("lru", "sieve", "fifo").
    Raises:
        ValueError: block_bytes < 1, capacity_bytes < 0, or an unknown policy.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, segment: str, policy: str = "lru"):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.segment = segment
        self.index = SlotIndex(capacity_bytes // block_bytes, policy)
        # np.empty: pages are faulted in on first write, so a large pool costs
        # nothing until it fills.
        self.buffer = np.empty(self.index.num_slots * block_bytes, dtype=np.uint8)

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes: a writable uint8 view of shape [block_bytes] into the pool."""
        off = slot * self.block_bytes
        return self.buffer[off: off + self.block_bytes]

    def location(self, key: bytes) -> Location | None:
        """(segment, offset, length) of `key` in the pool (bytes), or None if not held."""
        slot = self.index.slot_of(key)
        if slot is None:
            return None
        return Location(self.segment, slot * self.block_bytes, self.block_bytes)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the pool (a whole number of slots)."""
        return self.index.num_slots * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding blocks or reserved for a block being written."""
        return self.index.used_slots * self.block_bytes
