"""The learned per-request TTFT overhead (conductor/refit.py `ttft_overhead_s`, issue 33):
time a request's TTFT spends outside the engine steps the cost model predicts (RPCs,
waiting on the node, the KV push tail, tokenization, the first token's trip), learned from
the TTFTs the API nodes observe (NodeReport.ttfts), added to the predicted TTFT in the
admission check, and scored as an end-to-end error with and without it.

The conductor is driven through its handlers, as in test_admission_modes.py.
"""

from __future__ import annotations


import pytest

from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
from mooncaked.conductor.refit import OVERHEAD_MIN_SAMPLES, CostModelRefitter, ttft_overhead_s
from mooncaked.conductor.service import ConductorService
from mooncaked.config import Settings
from mooncaked.wire.messages import NodeReport
from cluster_harness import place, report

# 0.1 s + 10 ms a token of prefill: a 100-token request alone is predicted at 1.1 s
COST = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.1, 0.01)),
                 decode=PolyModel(((0, 0), (1, 0)), (0.05, 0.01)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000, meta={"source": "test"})


def settings(refit: bool = True) -> Settings:
    s = Settings()
    s.conductor.ttft_slo_s, s.conductor.tbt_slo_s = 2.0, 1.0
    s.conductor.refit_cost_model = refit
    s.engine.block_size = 16
    return s


def test_overhead_is_the_median_gap_not_below_zero():
    assert ttft_overhead_s([0.5] * (OVERHEAD_MIN_SAMPLES - 1)) == 0.0     # too few yet
    assert ttft_overhead_s([0.2, 0.4, 0.6, 5.0, 0.3, 0.5, 0.4, 0.45]) == pytest.approx(0.425)
    assert ttft_overhead_s([-0.3] * 10) == 0.0          # over-predicted compute: not ours
    assert ttft_overhead_s([1.0, 2.0, 3.0], min_samples=3) == 2.0


def test_refitter_scores_end_to_end_ttft_with_and_without_the_overhead():
    m = CostModelRefitter(settings(), COST)
    for i in range(OVERHEAD_MIN_SAMPLES):         # predicted 1.0 s, observed 1.5 s
        m.predicted(f"r{i}", 1.0, 0.0)
        m.observe_ttft(f"r{i}", 1.5)
    assert m.ttft_overhead_s() == pytest.approx(0.5)
    m.predicted("next", 1.0, 0.0)                 # placed with the 0.5 s overhead in use
    m.observe_ttft("next", 1.5)
    m.observe_ttft("never-placed", 9.0)           # ignored
    st = m.status()
    assert st["ttft_overhead_s"] == pytest.approx(0.5)
    comp, e2e = st["ttft_e2e_prediction_compute_only"], st["ttft_e2e_prediction"]
    assert comp["samples"] == e2e["samples"] == OVERHEAD_MIN_SAMPLES + 1
    assert comp["median_rel_error"] == pytest.approx(-1 / 3)    # under-predicted by a third
    # the first 8 were placed before any overhead was learned; the last one with it
    assert sorted(m.e2e_errors)[-1] == pytest.approx(0.0)
    # a fixed model (conductor.refit_cost_model = false) adds nothing
    fixed = CostModelRefitter(settings(refit=False), COST)
    for i in range(OVERHEAD_MIN_SAMPLES):
        fixed.predicted(f"r{i}", 1.0, 0.0)
        fixed.observe_ttft(f"r{i}", 1.5)
    assert fixed.ttft_overhead_s() == 0.0 and fixed.status()["ttft_e2e_prediction"]["samples"] == 8


def test_admission_adds_the_learned_overhead_to_the_predicted_ttft():
    svc = ConductorService("c1", None, None, settings(), cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    # a 150-token request alone: 1.6 s predicted, admitted under the 2 s SLO
    assert place(svc, "warm", n=150)["ok"]
    report(svc, "p1", "prefill", arrived=["warm"],
           done=[{"rid": "warm", "seconds": 1.6, "new": 150, "cached": 0, "alone": True}])
    # the API node saw every TTFT 0.6 s above what was predicted for it
    rids = [f"r{i}" for i in range(OVERHEAD_MIN_SAMPLES)]
    for rid in rids:
        assert place(svc, rid, n=10)["ok"]                    # 0.2 s each
        report(svc, "p1", "prefill", arrived=[rid],
               done=[{"rid": rid, "seconds": 0.2, "new": 10, "cached": 0, "alone": True}])
    report(svc, "c0", "cache", ttfts=[[rid, 0.8] for rid in rids])
    st = svc.status()
    assert st["ttft_overhead_s"] == pytest.approx(0.6)
    assert st["ttft_e2e_prediction_compute_only"]["median_rel_error"] == pytest.approx(-0.75)
    # now 1.6 s + 0.6 s = 2.2 s > 2 s: the same request is a TTFT miss on this idle
    # cluster, so one no wait can cure; the longest prompt that passes leaves room for
    # the overhead: 0.1 + 0.01 n + 0.6 <= 2 s, n <= 130
    r = place(svc, "again", n=150)
    assert not r["ok"] and r["reason"] == "ttft_slo_unattainable"
    assert 100 <= r["max_prompt_tokens"] <= 130
    assert r["predicted_ttft_s"] == pytest.approx(2.2)
    assert svc.admissions(["again"])["decisions"]["again"]["predicted_ttft_s"] == \
        pytest.approx(2.2, abs=1e-4)
    r = place(svc, "short", n=100)                            # 1.1 + 0.6 = 1.7 s: admitted
    assert r["ok"] and r["predicted_ttft_s"] == pytest.approx(1.7)


def test_report_carries_the_observed_ttfts_and_tbts():
    r = NodeReport("c0", "cache", ttfts=(("a", 0.25), ("b", 1.5)), tbts=(("a", 0.02),))
    back = NodeReport.from_json(r.to_json())
    assert back.ttfts == (("a", 0.25), ("b", 1.5)) and back.tbts == (("a", 0.02),)
    old = NodeReport.from_json({"node": "old"})                  # an older node's report
    assert old.ttfts == () and old.tbts == ()
