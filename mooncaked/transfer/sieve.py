"""SIEVE eviction for the endpoint pool (Zhang et al., NSDI'24), as Mooncake's transfer engine uses.

SIEVE keeps entries in insertion order with one "visited" bit each. A hit only sets
the bit (no reordering, so hits are cheap). To evict, a hand walks from the oldest
entry towards the newest, clearing set bits, and evicts the first entry whose bit is
clear; the hand stays where it stopped for the next eviction and wraps around.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Node(Generic[K, V]):
    __slots__ = ("key", "value", "visited", "newer", "older")

    def __init__(self, key: K, value: V):
        self.key, self.value = key, value
        self.visited = False
        self.newer: _Node | None = None
        self.older: _Node | None = None


class SieveCache(Generic[K, V]):
    """A capacity-bounded map with SIEVE eviction.

    Args:
        capacity: most entries kept (>= 1).
        evictable: optional predicate; an entry for which it returns False (e.g. an
            endpoint with work in flight) is skipped by the hand as if visited.
    """

    def __init__(self, capacity: int, evictable: Callable[[V], bool] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._evictable = evictable or (lambda v: True)
        self._map: dict[K, _Node[K, V]] = {}
        self._newest: _Node | None = None
        self._oldest: _Node | None = None
        self._hand: _Node | None = None

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: K) -> bool:
        return key in self._map

    def get(self, key: K) -> V | None:
        """The value for `key` (marking it visited), or None."""
        node = self._map.get(key)
        if node is None:
            return None
        node.visited = True
        return node.value

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Inserts (or replaces) `key`; returns the (key, value) pairs evicted to make room.

        When every entry is unevictable the cache grows past capacity rather than block;
        the surplus is evicted by later puts.
        """
        node = self._map.get(key)
        if node is not None:
            node.value, node.visited = value, True
            return []
        evicted = []
        while len(self._map) >= self.capacity:
            victim = self._pick_victim()
            if victim is None:
                break
            self._unlink(victim)
            evicted.append((victim.key, victim.value))
        node = _Node(key, value)
        self._map[key] = node
        node.older = self._newest
        if self._newest is not None:
            self._newest.newer = node
        self._newest = node
        if self._oldest is None:
            self._oldest = node
        return evicted

    def trim(self) -> list[tuple[K, V]]:
        """Evicts entries (SIEVE order, evictable ones only) until within capacity; returns
        them. Entries that had to be kept past capacity while busy go once they are idle."""
        evicted = []
        while len(self._map) > self.capacity:
            victim = self._pick_victim()
            if victim is None:
                break
            self._unlink(victim)
            evicted.append((victim.key, victim.value))
        return evicted

    def pop(self, key: K) -> V | None:
        """Removes `key`; returns its value, or None when absent."""
        node = self._map.get(key)
        if node is None:
            return None
        self._unlink(node)
        return node.value

    def items(self) -> Iterator[tuple[K, V]]:
        return ((k, n.value) for k, n in list(self._map.items()))

    def _pick_victim(self) -> _Node | None:
        # Two full sweeps suffice: the first clears every visited bit it passes.
        node = self._hand or self._oldest
        for _ in range(2 * len(self._map) + 1):
            if node is None:
                node = self._oldest
            if not node.visited and self._evictable(node.value):
                self._hand = node.newer
                return node
            node.visited = False
            node = node.newer
        return None

    def _unlink(self, node: _Node) -> None:
        del self._map[node.key]
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._newest = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._oldest = node.newer
        node.newer = node.older = None


__all__ = ["SieveCache"]
