"""Eviction policies of the store's tiers: LRU (the paper's, section 3.2.1), SIEVE, FIFO.

A policy only orders keys; the tier asks it for a victim and passes a
`can_evict(key)` predicate so pinned or leased blocks are skipped, never
evicted. `benchmarks/store.py` measures the prefix hit rate of each policy on
the conversation trace (see `mooncake bench store --policies`).

Prefix order matters for KV blocks: a block is useless without the blocks
before it, so the store touches a prefix's keys deepest-first (last key
first): under LRU the tail of a prefix is then evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable


class EvictionPolicy:
    """Order of eviction over a set of keys.

    Methods: `insert(key)` (a new key), `touch(key)` (a use), `remove(key)`,
    `victim(can_evict) -> key | None` (the next key to evict among those for
    which `can_evict(key)` is true; None if there is none). `victim` does not
    remove the key: the caller removes it once the block is really gone.
    """

    name = "base"

    def insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first (an OrderedDict: oldest at the front)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._order:
            if can_evict(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order


class FIFO(LRU):
    """First in, first out: like LRU but a use does not reorder (the baseline)."""

    name = "fifo"

    def touch(self, key: Hashable) -> None:
        pass


class _Node:
    __slots__ = ("key", "newer", "older", "visited")

    def __init__(self, key: Hashable):
        self.key = key
        self.newer: _Node | None = None
        self.older: _Node | None = None
        self.visited = False


class SIEVE(EvictionPolicy):
    """SIEVE (Zhang et al., NSDI'24): FIFO queue, a visited bit, and a moving hand.

    New keys enter at the head; the hand walks from the tail towards the head,
    clearing visited bits and evicting the first unvisited key. A use only sets
    the bit (no reordering), so hits cost O(1) without moving list nodes.
    """

    name = "sieve"

    def __init__(self) -> None:
        self._nodes: dict[Hashable, _Node] = {}
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None

    def insert(self, key: Hashable) -> None:
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
        node = self._nodes.get(key)
        if node is not None:
            node.visited = True

    def remove(self, key: Hashable) -> None:
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


POLICIES = {"lru": LRU, "sieve": SIEVE, "fifo": FIFO}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by name: "lru", "sieve" or "fifo". Raises ValueError otherwise."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})") from None
