"""Capacity sweep: each policy's highest arrival rate that keeps effective request capacity
at a target (the Mooncake paper's Figure 1, 6 and 7 way of comparing systems).

The arrival rate is changed through `time_scale` (rate multiplier m = 1 / time_scale):
the search doubles or halves m until the target is met on one side and missed on the
other, then bisects in log space. Bisection assumes the share of requests within their
SLOs falls as the rate rises; near the capacity it does not (a run at a higher rate can
pass where a lower one failed). So a fine grid of rates around the bisection's answer is
scanned too, the same for every policy, and two literal figures are read from every rate
sampled: the highest rate whose share meets the target (the issue's "highest arrival
rate with at least 90% of requests within TTFT and TBT"), and the conservative one, the
highest rate below which every sampled rate meets it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from mooncaked.conductor.cost_model import CostModel

from .engine import SimConfig, SimResult, simulate
from .trace import TraceRequest


def capacity_sweep(trace: Sequence[TraceRequest], base: SimConfig, policies: Sequence[str],
                   tbt_thresholds_s: Sequence[float], target: float = 0.9,
                   cost: CostModel | None = None, bisections: int = 5,
                   min_mult: float = 1 / 64, max_mult: float = 64.0,
                   scan_points: int = 16, scan_span: float = 0.1,
                   on_run: Callable[[str, float, SimResult], None] | None = None) -> dict:
    """Finds, per policy and TBT threshold, the highest arrival rate with share >= target.

    Args:
        trace: requests (their arrival times are scaled).
        base: cluster settings; `policy`, `time_scale` and `tbt_thresholds_s` are set here.
        policies: simulator policies to compare; the first one is the baseline of the ratios.
        tbt_thresholds_s: TBT thresholds (seconds); the TTFT threshold is base.ttft_threshold_s.
        target: share of requests that must meet both thresholds, in (0, 1].
        bisections: log-space bisection steps after bracketing (each halves the error;
            5 leaves about 2%).
        scan_points: rates scanned after the bisection, geometrically spaced from
            m * (1 - scan_span / 4) to m * (1 + scan_span) around its answer m (0 = none).
        scan_span: the scan's width above m, as a fraction of m.
        on_run: called after each simulation with (policy, rate multiplier, result).
    Returns: {"target", "ttft_threshold_s", "runs", "results": {policy: {thr: {...}}},
        "ratio_vs_<baseline>": {policy: {thr: ratio}}, "at_trace_rate" and
        "at_baseline_capacity": {policy: {arrival_rate_rps, ttft_mean_s, ttft_p90_s,
        ttft_max_s, cache_hit_rate, effective_request_capacity}} at the trace's own rate
        and at the baseline's capacity for the first threshold}; a rate is 0 when even
        min_mult fails. Each result also has "highest_passing_*" and "conservative_*"
        (rate_multiplier, rps, share; see `scan_capacity`) and "sampled" (every
        [multiplier, share] run, by rate), with "ratio_highest_passing_vs_<baseline>" and
        "ratio_conservative_vs_<baseline>" beside the bisection's ratios.
    Raises: ValueError on a target outside (0, 1].
    """
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    thresholds = tuple(float(t) for t in tbt_thresholds_s)
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 1.0
    base_rate = len(trace) / span if span > 0 else math.inf
    runs = 0
    out: dict = {}
    memos: dict[str, dict[float, dict]] = {}

    def summary(policy: str, mult: float) -> dict:
        nonlocal runs
        memo = memos.setdefault(policy, {})
        if mult not in memo:
            cfg = dataclasses.replace(base, policy=policy, time_scale=1.0 / mult,
                                      tbt_thresholds_s=thresholds)
            res = simulate(trace, cfg, cost)
            runs += 1
            memo[mult] = res.summary
            if on_run:
                on_run(policy, mult, res)
        return memo[mult]

    for policy in policies:
        def share(mult: float, thr: float, policy: str = policy) -> float:
            return summary(policy, mult)["effective_request_capacity_by_tbt"][f"{thr:g}"]

        per: dict = {}
        for thr in thresholds:
            m = 1.0
            if share(m, thr) >= target:
                lo, hi = m, None
                while hi is None and lo * 2 <= max_mult:
                    if share(lo * 2, thr) >= target:
                        lo *= 2
                    else:
                        hi = lo * 2
            else:
                lo, hi = None, m
                while lo is None and hi / 2 >= min_mult:
                    if share(hi / 2, thr) >= target:
                        lo = hi / 2
                    else:
                        hi /= 2
            if lo is not None and hi is not None:
                for _ in range(bisections):
                    mid = math.sqrt(lo * hi)
                    if share(mid, thr) >= target:
                        lo = mid
                    else:
                        hi = mid
            if lo is not None and hi is not None and scan_points > 0:
                a, b = math.log(lo * (1 - scan_span / 4)), math.log(lo * (1 + scan_span))
                for i in range(scan_points):
                    share(math.exp(a + (b - a) * i / max(scan_points - 1, 1)), thr)
            sampled = sorted((m, s["effective_request_capacity_by_tbt"][f"{thr:g}"])
                             for m, s in memos[policy].items())
            scan = scan_capacity(sampled, target)
            mult = lo or 0.0
            per[f"{thr:g}"] = {"rate_multiplier": mult,
                               "time_scale": 1.0 / mult if mult else math.inf,
                               "arrival_rate_rps": base_rate * mult,
                               "effective_request_capacity": share(mult, thr) if mult else 0.0,
                               "sampled": [[m, v] for m, v in sampled]}
            for kind in ("highest_passing", "conservative"):
                m, v = scan[kind]
                per[f"{thr:g}"].update({f"{kind}_rate_multiplier": m,
                                        f"{kind}_rps": base_rate * m, f"{kind}_share": v})
        out[policy] = per
    baseline = policies[0]
    ratios = {p: {thr: (v["arrival_rate_rps"] / out[baseline][thr]["arrival_rate_rps"]
                        if out[baseline][thr]["arrival_rate_rps"] else math.inf)
                  for thr, v in per.items()} for p, per in out.items()}
    extra = {f"ratio_{kind}_vs_{baseline}": {
        p: {thr: (v[f"{kind}_rps"] / out[baseline][thr][f"{kind}_rps"]
                  if out[baseline][thr][f"{kind}_rps"] else math.inf) for thr, v in per.items()}
        for p, per in out.items()} for kind in ("highest_passing", "conservative")}
    keys = ("arrival_rate_rps", "ttft_mean_s", "ttft_p90_s", "ttft_max_s", "cache_hit_rate",
            "effective_request_capacity")
    at_rate = {p: {k: summary(p, 1.0)[k] for k in keys} for p in policies}
    cap = out[baseline][f"{thresholds[0]:g}"]["rate_multiplier"]
    at_cap = {p: {k: summary(p, cap)[k] for k in keys} for p in policies} if cap else {}
    return {"target": target, "ttft_threshold_s": base.ttft_threshold_s, "runs": runs,
            "base_arrival_rate_rps": base_rate, "results": out, f"ratio_vs_{baseline}": ratios,
            "at_trace_rate": at_rate, "at_baseline_capacity": at_cap, **extra,
            "scan_points": scan_points, "scan_span": scan_span}


def scan_capacity(sampled: Sequence[tuple[float, float]], target: float) -> dict:
    """Capacity read literally from sampled (rate, share) pairs, in any order.

    Returns: {"highest_passing": (rate, share) of the highest rate whose share >= target,
        "conservative": (rate, share) of the highest rate below which every sampled rate
        meets the target (the highest passing rate under the lowest failing one)};
        (0.0, 0.0) where no rate qualifies.
    """
    pts = sorted(sampled)
    passing = [(m, v) for m, v in pts if v >= target]
    first_fail = next((m for m, v in pts if v < target), math.inf)
    below = [(m, v) for m, v in passing if m < first_fail]
    return {"highest_passing": passing[-1] if passing else (0.0, 0.0),
            "conservative": below[-1] if below else (0.0, 0.0)}
