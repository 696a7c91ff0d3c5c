"""Aggregate replay records into the paper's measures (all from mooncaked.measures)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mooncaked.measures import cache_hit_rate, effective_request_capacity, percentile

from .runner import RequestRecord

DEFAULT_TTFT_SLO_S = 30.0
"""The paper's TTFT threshold (section 5)."""
DEFAULT_TBT_SLOS_S = (0.1, 0.2, 0.3)
"""The paper's TBT thresholds (Figure 1)."""


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def slo_key(tbt_slo_s: float) -> str:
    """Key of one TBT threshold in `effective_request_capacity`: seconds, e.g. "0.1"."""
    return f"{tbt_slo_s:g}"


def summarize(records: Sequence[RequestRecord], wall_s: float,
              ttft_slo_s: float = DEFAULT_TTFT_SLO_S,
              tbt_slos_s: Sequence[float] = DEFAULT_TBT_SLOS_S) -> dict[str, Any]:
    """One summary dict of a replay.

    Keys: requests, completed, rejected (HTTP 429), errors (other failures), ttft_mean_s,
    ttft_p50_s, ttft_p90_s, ttft_p99_s, tbt_mean_s, tbt_p90_s (over completed requests;
    None when there are none), prompt_tokens, cached_tokens, output_tokens (completed
    requests), cache_hit_rate (cached / prompt tokens over completed requests whose usage
    reported cached_tokens; None if none did), wall_s, duration_s (first send to last
    finish), output_throughput_tok_s and input_throughput_tok_s (tokens of completed
    requests / duration_s), ttft_slo_s, effective_request_capacity ({slo_key(tbt):
    share}; rejected, failed and token-less requests count as misses).
    """
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tbts = [r.tbt_s for r in done if r.tbt_s is not None]
    rejected = sum(1 for r in records if r.rejected)
    errors = sum(1 for r in records if not r.ok and not r.rejected)
    hit = [r for r in done if r.cached_tokens is not None]
    starts = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(starts)) if starts and ends else 0.0
    prompt_tok = sum(r.prompt_tokens or 0 for r in done)
    out_tok = sum(r.output_tokens or 0 for r in done)
    paired = [(r.ttft_s, r.tbt_s) for r in done if r.ttft_s is not None and r.tbt_s is not None]
    misses = len(records) - len(paired)
    capacity = {
        slo_key(slo): effective_request_capacity([a for a, _ in paired], [b for _, b in paired],
                                                 ttft_slo_s, slo, rejected=misses)
        for slo in tbt_slos_s
    }
    return {
        "requests": len(records),
        "completed": len(done),
        "rejected": rejected,
        "errors": errors,
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": _num(percentile(ttfts, 50)),
        "ttft_p90_s": _num(percentile(ttfts, 90)),
        "ttft_p99_s": _num(percentile(ttfts, 99)),
        "tbt_mean_s": _mean(tbts),
        "tbt_p90_s": _num(percentile(tbts, 90)),
        "prompt_tokens": prompt_tok,
        "cached_tokens": sum(r.cached_tokens for r in hit),
        "output_tokens": out_tok,
        "cache_hit_rate": (cache_hit_rate(sum(r.cached_tokens for r in hit),
                                          sum(r.prompt_tokens or 0 for r in hit))
                           if hit else None),
        "wall_s": wall_s,
        "duration_s": duration,
        "output_throughput_tok_s": out_tok / duration if duration > 0 else None,
        "input_throughput_tok_s": prompt_tok / duration if duration > 0 else None,
        "ttft_slo_s": ttft_slo_s,
        "effective_request_capacity": capacity,
    }
