"""Capacity sweep on a made-up, non-monotone share curve (no simulation): the bisection,
the highest passing sampled rate and the conservative capacity read different rates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncaked.sim import sweep
from mooncaked.sim.engine import SimConfig
from mooncaked.sim.sweep import capacity_sweep, scan_capacity
from mooncaked.sim.trace import TraceRequest


def share_at(mult: float) -> float:
    """Passes up to 3.5x, dips to 0.8 in (3.5, 3.55), passes again up to 3.6x, then fails."""
    if mult <= 3.5:
        return 1.0
    if mult < 3.55:
        return 0.8
    return 0.95 if mult <= 3.6 else 0.5


def test_scan_capacity_reads_both_definitions():
    pts = [(3.6, 0.95), (1.0, 1.0), (3.52, 0.8), (3.4, 0.92), (3.7, 0.5)]
    out = scan_capacity(pts, 0.9)
    assert out["highest_passing"] == (3.6, 0.95)
    assert out["conservative"] == (3.4, 0.92)
    assert scan_capacity([(1.0, 0.5)], 0.9) == {"highest_passing": (0.0, 0.0),
                                                "conservative": (0.0, 0.0)}
    assert scan_capacity([(1.0, 0.95), (2.0, 0.91)], 0.9)["conservative"] == (2.0, 0.91)


def test_sweep_scan_finds_the_pass_beyond_a_dip_the_bisection_stops_at(monkeypatch):
    def fake_simulate(trace, cfg, cost=None):
        m = 1.0 / cfg.time_scale
        s = share_at(m)
        return SimpleNamespace(summary={
            "effective_request_capacity_by_tbt": {"0.1": s}, "arrival_rate_rps": m,
            "ttft_mean_s": 1.0, "ttft_p90_s": 2.0, "ttft_max_s": 3.0, "cache_hit_rate": 0.5,
            "effective_request_capacity": s})

    monkeypatch.setattr(sweep, "simulate", fake_simulate)
    trace = [TraceRequest(float(i), 100, 1, ()) for i in range(11)]     # 1.1 req/s
    out = capacity_sweep(trace, SimConfig(), ["global_cache_aware", "cost_aware"], (0.1,),
                         scan_points=16, scan_span=0.1)
    r = out["results"]["global_cache_aware"]["0.1"]
    # bisection: 2 passes, 4 fails, then 2.83, 3.36 pass, 3.67 fails, 3.51 (the dip) fails,
    # 3.44 passes: it stops below the dip, at 2 ** (1 + 1/2 + 1/4 + 1/32)
    assert r["rate_multiplier"] == pytest.approx(2 ** 1.78125)
    assert 3.55 <= r["highest_passing_rate_multiplier"] <= 3.6     # the pass beyond the dip
    assert r["highest_passing_share"] == 0.95
    assert r["highest_passing_rps"] == pytest.approx(1.1 * r["highest_passing_rate_multiplier"])
    assert r["rate_multiplier"] <= r["conservative_rate_multiplier"] <= 3.5    # below the dip
    assert all(v >= 0.9 for m, v in r["sampled"] if m <= r["conservative_rate_multiplier"])
    assert any(v < 0.9 for m, v in r["sampled"] if m < r["highest_passing_rate_multiplier"])
    assert out["ratio_highest_passing_vs_global_cache_aware"]["cost_aware"]["0.1"] == pytest.approx(1.0)
    assert out["ratio_conservative_vs_global_cache_aware"]["global_cache_aware"]["0.1"] == pytest.approx(1.0)
    no_scan = capacity_sweep(trace, SimConfig(), ["cost_aware"], (0.1,), scan_points=0)
    n = no_scan["results"]["cost_aware"]["0.1"]
    assert n["highest_passing_rate_multiplier"] == pytest.approx(r["rate_multiplier"])
