"""The paper's measures (Mooncake, FAST'25, section 5 and architecture.md "Measures").

Shared by the live benchmarks, the simulator and the metrics so all report the
same definitions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def tbt_s(token_times_s: Sequence[float]) -> float:
    """TBT of one request: the mean of the longest 10% of its inter-token gaps, seconds.

    Args:
        token_times_s: arrival times of each output token (first token included), seconds,
            non-decreasing.
    Returns: the mean of the ceil(10%) largest gaps; 0.0 for fewer than two tokens.
    Source: Mooncake paper, section 5 ("TBT ... the average of the longest 10% of the
        token arrival intervals").
    """
    gaps = sorted((b - a for a, b in zip(token_times_s, token_times_s[1:])), reverse=True)
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) * 0.1))
    return sum(gaps[:k]) / k


def effective_request_capacity(ttfts_s: Sequence[float], tbts_s: Sequence[float],
                               ttft_slo_s: float, tbt_slo_s: float,
                               rejected: int = 0) -> float:
    """Share of requests whose TTFT and TBT both meet their thresholds, in [0, 1].

    Rejected or failed requests count as misses: pass their number in `rejected`
    (they have no TTFT/TBT entries).
    Raises: ValueError if the two lists differ in length.
    Source: Mooncake paper, section 5 (TTFT threshold 30 s; TBT 100/200/300 ms).
    """
    if len(ttfts_s) != len(tbts_s):
        raise ValueError("ttfts_s and tbts_s must have the same length")
    total = len(ttfts_s) + rejected
    if total == 0:
        return 0.0
    ok = sum(1 for a, b in zip(ttfts_s, tbts_s) if a <= ttft_slo_s and b <= tbt_slo_s)
    return ok / total


def cache_hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached prompt tokens / prompt tokens (0.0 when there are no prompt tokens)."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
