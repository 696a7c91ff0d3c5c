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

from mooncaked.transfer.sieve import SieveOrder


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


class SIEVE(SieveOrder, EvictionPolicy):
    """SIEVE (Zhang et al., NSDI'24); the same order the transfer engine's endpoint pool uses."""

    name = "sieve"


POLICIES = {"lru": LRU, "sieve": SIEVE, "fifo": FIFO}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by name: "lru", "sieve" or "fifo". Raises ValueError otherwise."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})") from None
