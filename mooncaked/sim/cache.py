"""A per-node LRU cache of KV blocks, sized in tokens (the store's DRAM pool in the simulator)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence


class LRUCache:
    """Blocks of `block_tokens` tokens each, evicted least-recently-used first.

    Keys of one request are touched from last to first, so a prefix's head is the most
    recent and a prefix is evicted from its tail: what is left is still a usable prefix.
    Capacity `math.inf` never evicts.
    """

    def __init__(self, capacity_tokens: float, block_tokens: int = 512):
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.capacity_blocks = math.inf if math.isinf(capacity_tokens) else int(
            capacity_tokens // block_tokens)
        self._d: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def match(self, keys: Sequence[Hashable]) -> int:
        """Number of leading keys held (the prefix match), without touching them."""
        d = self._d
        m = 0
        for k in keys:
            if k not in d:
                break
            m += 1
        return m

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Marks the held ones of `keys` most recently used (head of the prefix last)."""
        d = self._d
        for k in reversed(keys):
            if k in d:
                d.move_to_end(k)

    def insert(self, keys: Sequence[Hashable]) -> tuple[list, list]:
        """Stores `keys` (touching those held) and evicts down to capacity.

        Returns: (keys newly stored, keys evicted); a key may be in both when the cache is
        smaller than the request.
        """
        d = self._d
        new = []
        for k in reversed(keys):
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
                new.append(k)
        evicted = []
        while len(d) > self.capacity_blocks:
            evicted.append(d.popitem(last=False)[0])
        return new, evicted
