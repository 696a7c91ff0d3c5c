"""The slot books both tiers of the store keep: key -> slot, free slots, eviction order.

The DRAM pool (dram.py) and the SSD tier (ssd.py) are the same design over two
backends: an array of `num_slots` fixed-size slots, one block per slot. They
differ only in where a slot's bytes live (a pool buffer, a slot file), so the
bookkeeping is written once, here, and each tier holds one `SlotIndex`.

A slot is in one of three states:
  - free: in the free list (`alloc` hands out the lowest free slot first);
  - reserved: taken by `alloc`, `take` or `drop` and neither indexed nor freed
    yet, i.e. its bytes are being written or cleared; only its taker uses it;
  - indexed: a key resolves to it (`insert`), and it is in the eviction order.

The eviction order is a pluggable policy (policy.py: "lru", "sieve", "fifo").
`victim` and `take` skip every key for which the caller's `can_evict(key)` is
false (pinned or leased blocks). No I/O and no clock: callers run on the
event loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .policy import EvictionPolicy, make_policy


class SlotIndex:
    """Key -> slot map, free-slot list and eviction order of one tier's slots.

    Args:
        num_slots: slots of the tier (>= 0); slot ids are 0 .. num_slots-1.
        policy: eviction policy name ("lru", "sieve", "fifo").
    Each indexed key may carry a `tag` (e.g. the SSD tier's checksum), kept and
    dropped together with its slot.
    Raises:
        ValueError: num_slots < 0, or an unknown policy.
    """

    def __init__(self, num_slots: int, policy: str = "lru"):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.policy: EvictionPolicy = make_policy(policy)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._slot: dict[bytes, int] = {}
        self._tag: dict[bytes, Any] = {}

    # ------------------------------------------------------------------ free slots

    def alloc(self) -> int | None:
        """Reserves a free slot and returns its id, or None when no slot is free."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Returns a reserved slot (from `alloc`, `take` or `drop`) to the free list."""
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        """Slots in the free list (blocks)."""
        return len(self._free)

    @property
    def used_slots(self) -> int:
        """Slots indexed or reserved (blocks): `num_slots - free_slots`."""
        return self.num_slots - len(self._free)

    # ------------------------------------------------------------------ index

    def insert(self, key: bytes, slot: int, tag: Any = None) -> None:
        """Makes `key` resolve to the reserved `slot` (whose bytes the caller wrote),
        with an optional `tag`, and enters it in the eviction order as newest."""
        self._slot[key] = slot
        if tag is not None:
            self._tag[key] = tag
        self.policy.insert(key)

    def drop(self, key: bytes) -> int:
        """Unindexes `key` and returns its slot, now reserved (not yet freed).
        Raises: KeyError if `key` is not indexed."""
        slot = self._slot.pop(key)
        self._tag.pop(key, None)
        self.policy.remove(key)
        return slot

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding `key`, or None."""
        return self._slot.get(key)

    def tag_of(self, key: bytes) -> Any:
        """The tag `key` was inserted with, or None."""
        return self._tag.get(key)

    def entry(self, key: bytes) -> tuple[int, Any] | None:
        """(slot, tag) of `key`, or None if it is not indexed."""
        slot = self._slot.get(key)
        return None if slot is None else (slot, self._tag.get(key))

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def keys(self) -> list[bytes]:
        """Every indexed key, in no particular order."""
        return list(self._slot)

    # ------------------------------------------------------------------ eviction order

    def touch(self, key: bytes) -> None:
        """Records a use of `key` for the eviction order (no-op if not indexed)."""
        self.policy.touch(key)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The next key to evict among those with `can_evict(key)` true, or None.
        Nothing is dropped: the caller drops it once the block is really gone."""
        return self.policy.victim(can_evict)

    def take(self, can_evict: Callable[[bytes], bool]) -> tuple[int, bytes | None] | None:
        """A reserved slot for a new block: (a free slot, None), else (the victim's slot,
        the victim's key) with the victim dropped from the index; None when every
        slot holds a block that `can_evict` refuses."""
        if self._free:
            return self._free.pop(), None
        key = self.policy.victim(can_evict)
        if key is None:
            return None
        return self.drop(key), key

    def load(self, entries: Iterable[tuple[bytes, int, Any]]) -> list[int]:
        """Indexes blocks found at start-up, on an empty index.

        `entries` are (key, slot, tag), oldest first (the eviction order starts from
        the first). A key seen again keeps its first slot; the later slots are
        returned (they are free, like every slot not indexed).
        Raises: ValueError if the index is not empty or a slot is out of range.
        """
        if self._slot:
            raise ValueError("SlotIndex.load needs an empty index")
        dups: list[int] = []
        for key, slot, tag in entries:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
            if key in self._slot:
                dups.append(slot)
                continue
            self.insert(key, slot, tag)
        used = set(self._slot.values())
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        return dups


class SlotTier:
    """Base of the store's two tiers: `index` (a SlotIndex) books their slots.

    Subclasses (DramPool, SsdTier) set `self.index` and say where slot bytes live.
    Membership, size, key listing and touches are the index's.
    """

    index: SlotIndex

    @property
    def num_slots(self) -> int:
        """Slots of the tier (blocks)."""
        return self.index.num_slots

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def keys(self) -> list[bytes]:
        """Every key held, in no particular order."""
        return self.index.keys()

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding `key`, or None."""
        return self.index.slot_of(key)

    def touch(self, key: bytes) -> None:
        """Records a use of `key` for the eviction order."""
        self.index.touch(key)
