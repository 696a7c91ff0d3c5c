"""Cache hit rate of a trace against cache capacity, one cache, requests in order (Figure 9).

This is the trace's own bound: every request sees the prefix blocks of all requests
before it (up to the capacity), as if one node served everything one request at a
time. The simulator's per-node caches can only do worse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mooncaked.measures import cache_hit_rate

from .cache import LRUCache
from .trace import TRACE_BLOCK_TOKENS, TraceRequest


def sequential_hit_rate(trace: Sequence[TraceRequest], capacity_tokens: float = math.inf,
                        block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """Hit rate (cached prompt tokens / prompt tokens) with one LRU cache of `capacity_tokens`.

    A request's cached tokens are min(matched blocks * block_tokens, prompt tokens);
    after it, all its blocks are stored. Unbounded capacity on the conversation trace
    gives 0.374 (shared/traces/README.md).
    """
    hit = total = 0
    if math.isinf(capacity_tokens):
        seen: set = set()
        for r in trace:
            m = 0
            for k in r.keys:
                if k not in seen:
                    break
                m += 1
            hit += min(m * block_tokens, r.input_tokens)
            total += r.input_tokens
            seen.update(r.keys)
        return cache_hit_rate(hit, total)
    cache = LRUCache(capacity_tokens, block_tokens)
    for r in trace:
        m = cache.match(r.keys)
        hit += min(m * block_tokens, r.input_tokens)
        total += r.input_tokens
        cache.insert(r.keys)
    return cache_hit_rate(hit, total)
