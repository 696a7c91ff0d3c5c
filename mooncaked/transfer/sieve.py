"""SIEVE eviction (Zhang et al., NSDI'24), as Mooncake's transfer engine uses for endpoints.

SIEVE keeps entries in insertion order with one "visited" bit each. A hit only sets
the bit (no reordering, so hits are cheap). To evict, a hand walks from the oldest
entry towards the newest, clearing set bits, and evicts the first entry whose bit is
clear; the hand stays where it stopped for the next eviction and wraps around.

`SieveOrder` is the key order alone (the KV store's tiers use it as an eviction
policy); `SieveCache` is a capacity-bounded map on top of it (the endpoint pool).
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Node:
    __slots__ = ("key", "newer", "older", "visited")

    def __init__(self, key: Hashable):
        self.key = key
        self.newer: _Node | None = None
        self.older: _Node | None = None
        self.visited = False


class SieveOrder:
    """SIEVE (Zhang et al., NSDI'24): FIFO queue, a visited bit, and a moving hand.

    New keys enter at the head; the hand walks from the tail towards the head,
    clearing visited bits and evicting the first unvisited key. A use only sets
    the bit (no reordering), so hits cost O(1) without moving list nodes.
    """

    def __init__(self) -> None:
        self._nodes: dict[Hashable, _Node] = {}
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None

    def insert(self, key: Hashable) -> None:
        """Adds `key` as the newest (a known key is only touched)."""
        if key in self._nodes:
            self.touch(key)
            return
        node = _Node(key)
        node.older = self._head
        if self._head is not None:
            self._head.newer = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._nodes[key] = node

    def touch(self, key: Hashable) -> None:
        """Marks a use: sets the visited bit, no reordering."""
        node = self._nodes.get(key)
        if node is not None:
            node.visited = True

    def remove(self, key: Hashable) -> None:
        """Forgets `key` (no-op if unknown)."""
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._head = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._tail = node.newer

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        """The next key to evict among those `can_evict` accepts (not removed); None if none."""
        node = self._hand or self._tail
        # Two full passes: the first may only clear visited bits.
        for _ in range(2 * len(self._nodes) + 1):
            if node is None:
                node = self._tail
                if node is None:
                    return None
            if node.visited:
                node.visited = False
            elif can_evict(node.key):
                self._hand = node.newer
                return node.key
            node = node.newer
        return None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._nodes


class SieveCache(Generic[K, V]):
    """A capacity-bounded map with SIEVE eviction.

    Args:
        capacity: most entries kept (>= 1).
        evictable: optional predicate; an entry for which it returns False (e.g. an
            endpoint with work in flight) is skipped by the hand.
    Raises: ValueError for capacity < 1.
    """

    def __init__(self, capacity: int, evictable: Callable[[V], bool] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._evictable = evictable or (lambda v: True)
        self._values: dict[K, V] = {}
        self._order = SieveOrder()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: K) -> bool:
        return key in self._values

    def get(self, key: K) -> V | None:
        """The value for `key` (marking it visited), or None."""
        if key not in self._values:
            return None
        self._order.touch(key)
        return self._values[key]

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Inserts (or replaces) `key`; returns the (key, value) pairs evicted to make room.

        When every entry is unevictable the cache grows past capacity rather than block;
        the surplus is evicted by later puts.
        """
        if key in self._values:
            self._values[key] = value
            self._order.touch(key)
            return []
        evicted = self._evict_down_to(self.capacity - 1)
        self._values[key] = value
        self._order.insert(key)
        return evicted

    def trim(self) -> list[tuple[K, V]]:
        """Evicts entries (SIEVE order, evictable ones only) until within capacity; returns
        them. Entries that had to be kept past capacity while busy go once they are idle."""
        return self._evict_down_to(self.capacity)

    def pop(self, key: K) -> V | None:
        """Removes `key`; returns its value, or None when absent."""
        if key not in self._values:
            return None
        self._order.remove(key)
        return self._values.pop(key)

    def items(self) -> Iterator[tuple[K, V]]:
        """(key, value) pairs, a snapshot."""
        return iter(list(self._values.items()))

    def _evict_down_to(self, size: int) -> list[tuple[K, V]]:
        evicted = []
        while len(self._values) > size:
            key = self._order.victim(lambda k: self._evictable(self._values[k]))
            if key is None:
                break
            self._order.remove(key)
            evicted.append((key, self._values.pop(key)))
        return evicted


__all__ = ["SieveCache", "SieveOrder"]
