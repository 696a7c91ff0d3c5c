"""The DRAM tier: one preallocated pool of fixed-size slots per node (paper section 3.2.1).

The pool is a single uint8 buffer of `num_slots * block_bytes` bytes. Slot i
holds one KV block at byte offset `i * block_bytes`, so the whole pool can be
registered with the transfer engine as one segment and a peer reads block K
directly at `location(K) = (segment, offset, block_bytes)`.

This class only keeps the slot map and the eviction order; pins, leases,
demotion to SSD and events live in `BlockStore` (store.py), which calls it
from the event loop thread only.
"""

from __future__ import annotations

import numpy as np

from .policy import EvictionPolicy, make_policy
from .types import Location


class DramPool:
    """Fixed-size slots in one preallocated buffer, keyed by block key.

    Args:
        capacity_bytes: bytes lent to the pool; `capacity_bytes // block_bytes` slots.
        block_bytes: bytes of one block (all blocks of one model have this size).
        segment: name under which the pool is (or will be) registered with the
            transfer engine; it appears in every `Location`.
        policy: eviction policy name ("lru", "sieve", "fifo").
    Raises:
        ValueError: block_bytes < 1 or capacity_bytes < 0.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, segment: str, policy: str = "lru"):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        self.segment = segment
        # np.empty: pages are faulted in on first write, so a large pool costs
        # nothing until it fills.
        self.buffer = np.empty(self.num_slots * block_bytes, dtype=np.uint8)
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._slot: dict[bytes, int] = {}
        self.policy: EvictionPolicy = make_policy(policy)

    # -- slots

    def alloc(self) -> int | None:
        """A free slot index, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Returns an unindexed slot (from `alloc` or `drop`) to the free list."""
        self._free.append(slot)

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes: a writable uint8 view of shape [block_bytes] into the pool."""
        off = slot * self.block_bytes
        return self.buffer[off: off + self.block_bytes]

    # -- index

    def insert(self, key: bytes, slot: int) -> None:
        """Makes `key` resolve to `slot` (whose bytes the caller already wrote)."""
        self._slot[key] = slot
        self.policy.insert(key)

    def drop(self, key: bytes) -> int:
        """Removes `key` from the index and returns its slot (not yet freed). KeyError if absent."""
        slot = self._slot.pop(key)
        self.policy.remove(key)
        return slot

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding `key`, or None."""
        return self._slot.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def keys(self) -> list[bytes]:
        """Every key held, in no particular order."""
        return list(self._slot)

    def location(self, key: bytes) -> Location | None:
        """(segment, offset, length) of `key` in the pool, or None if not held."""
        slot = self._slot.get(key)
        if slot is None:
            return None
        return Location(self.segment, slot * self.block_bytes, self.block_bytes)

    @property
    def address(self) -> int:
        """Virtual address of the pool's first byte (for memory registration)."""
        return int(self.buffer.ctypes.data)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the pool (a whole number of slots)."""
        return self.num_slots * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding blocks or reserved for a block being written."""
        return (self.num_slots - len(self._free)) * self.block_bytes
