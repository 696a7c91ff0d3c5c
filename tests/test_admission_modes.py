"""Admission modes (conductor.admission, conductor.node_admission: enforce | shadow | off),
the warm-up that keeps a built-in default model from rejecting, the ledger of decisions,
and the fast calibration of the cost model from timed steps (issue 33).

The conductor is driven through its handlers (`report`, `place`, `admissions`) without a
coordinator, as in test_conductor_service.py; the decode node's check through
DecodeAdmission.
"""

from __future__ import annotations

import math

import pytest

from mooncaked.cluster.admission import START_DELAY_MIN_SAMPLES, DecodeAdmission, still_decoding
from cluster_harness import place, report
from mooncaked.conductor.admission_ledger import (ADMIT, REJECT, SHADOW, AdmissionLedger,
                                                  Decision, decide, in_holdout)
from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
from mooncaked.conductor.refit import CALIBRATE_EVERY, TBT_MAX_AGE_S, TBT_MIN_SAMPLES
from mooncaked.conductor.cost_store import default_cost_model
from mooncaked.conductor.service import ConductorService
from mooncaked.config import Settings

# 0.1 s + 10 ms a token of prefill; 50 ms + 10 ms a sequence a decode step
COST = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.1, 0.01)),
                 decode=PolyModel(((0, 0), (1, 0)), (0.05, 0.01)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000,
                 meta={"source": "test"})


def settings(mode: str = "enforce", warmup: int = 8, ttft_slo: float = 3.0) -> Settings:
    s = Settings()
    s.conductor.admission = mode
    s.conductor.node_admission = mode
    s.conductor.admission_warmup = warmup
    s.conductor.ttft_slo_s = ttft_slo
    s.conductor.tbt_slo_s = 1.0
    s.engine.block_size = 16
    return s


def test_decide_covers_every_mode():
    assert decide("enforce", None, True) == ADMIT
    assert decide("enforce", "ttft_slo", True) == REJECT
    assert decide("enforce", "ttft_slo", False) == SHADOW     # a model not calibrated yet
    assert decide("shadow", "tbt_slo", True) == SHADOW
    assert decide("off", "tbt_slo", True) == ADMIT
    with pytest.raises(ValueError, match="unknown admission mode"):
        decide("sometimes", None, True)
    # a request in the holdout is admitted and counted, as shadow
    assert decide("enforce", "ttft_slo", True, holdout=True) == SHADOW
    assert decide("enforce", None, True, holdout=True) == ADMIT


def test_the_holdout_holds_its_share_of_request_ids_the_same_at_every_check():
    rids = [f"cmpl-{i:032x}-0" for i in range(2000)]
    assert not any(in_holdout(0.0, r) for r in rids)
    assert all(in_holdout(1.0, r) for r in rids)
    quarter = {r for r in rids if in_holdout(0.25, r)}
    assert 400 <= len(quarter) <= 600                   # binomial sd 19: a wide bound
    assert quarter == {r for r in rids if in_holdout(0.25, r)}     # a hash, not a draw
    assert quarter <= {r for r in rids if in_holdout(0.5, r)}      # nested by share


def test_enforce_with_a_holdout_admits_the_predicted_miss_as_shadow():
    """conductor.admission_holdout = 1: enforcing, every predicted miss is admitted and
    recorded as a shadow rejection, at the conductor and at the decode node."""
    s = settings("enforce")
    s.conductor.admission_holdout = 1.0
    svc = ConductorService("c1", None, None, s, cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    a, b, c = (place(svc, r) for r in ("a", "b", "c"))
    assert a["ok"] and b["ok"] and c["ok"] and abs(c["predicted_ttft_s"] - 3.3) < 1e-9
    assert svc.status()["rejected"] == {}
    c_led = svc.admissions(["c"])
    assert c_led["decisions"]["c"]["verdict"] == "shadow" and c_led["decisions"]["c"]["held_out"]
    assert c_led["held_out"] == 1
    # a prompt over the TTFT SLO on an idle cluster too (0.1 + 400 x 10 ms = 4.1 s > 3 s) is
    # not held out: no load explains it, and admitting it would hold p1 for seconds
    big = place(svc, "big", n=400)
    assert not big["ok"] and big["reason"] == "ttft_slo_unattainable"
    assert svc.admissions(["big"])["decisions"]["big"]["verdict"] == "reject"
    adm = DecodeAdmission(s, 1000)
    adm.model.cost = COST
    adm.model.observe_step(1, 100, COST.decode_step_s(1, 100))    # not the default: calibrated
    assert adm.model.calibrated("decode")
    assert adm.check(199, 0, 0, "r1") is None and adm.refused == 0   # 2.06 s > 1 s, held out
    r1 = adm.ledger_view(["r1"])
    assert r1["decisions"]["r1"]["verdict"] == "shadow" and r1["decisions"]["r1"]["held_out"]
    assert r1["held_out"] == 1 and r1["holdout_share"] == 1.0
    s.conductor.admission_holdout = 0.0
    adm = DecodeAdmission(s, 1000)
    adm.model.cost = COST
    adm.model.observe_step(1, 100, COST.decode_step_s(1, 100))
    assert adm.check(199, 0, 0, "r2") is not None and adm.refused == 1


def test_ledger_counts_and_keeps_the_newest():
    led = AdmissionLedger(size=2)
    led.record("a", Decision(ADMIT, "", 1.0, 0.1, True))
    led.record("b", Decision(SHADOW, "ttft_slo", 9.0, math.nan, False))
    led.record("c", Decision(REJECT, "tbt_slo", 1.0, 2.0, True))
    assert led.status() == {"admitted": 1, "rejected": 1, "shadow_rejected": 1, "held_out": 0,
                            "rejected_by_reason": {"tbt_slo": 1},
                            "shadow_rejected_by_reason": {"ttft_slo": 1}}
    assert set(led.entries()) == {"b", "c"}                   # "a" fell out
    assert led.entries(["b", "zz"]) == {"b": {"verdict": "shadow", "reason": "ttft_slo",
                                              "predicted_ttft_s": 9.0, "predicted_tbt_s": None,
                                              "calibrated": False, "held_out": False}}


def _queue_three(mode: str) -> tuple[ConductorService, list[dict]]:
    """Three 100-token requests between two reports: 1.1, 2.2 and 3.3 s predicted TTFT
    against a 3 s SLO, so the third is predicted to miss."""
    svc = ConductorService("c1", None, None, settings(mode), cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    return svc, [place(svc, r) for r in ("a", "b", "c")]


def test_enforce_rejects_the_predicted_miss():
    svc, (a, b, c) = _queue_three("enforce")
    assert a["ok"] and b["ok"] and not c["ok"] and c["reason"] == "ttft_slo"
    led = svc.admissions()
    assert led["rejected"] == 1 and led["decisions"]["c"]["verdict"] == "reject"
    assert abs(led["decisions"]["c"]["predicted_ttft_s"] - 3.3) < 1e-4
    assert abs(led["decisions"]["b"]["predicted_ttft_s"] - 2.2) < 1e-4


def test_shadow_admits_the_predicted_miss_and_counts_it():
    svc, (a, b, c) = _queue_three("shadow")
    assert a["ok"] and b["ok"] and c["ok"]                     # placed all the same
    assert abs(c["predicted_ttft_s"] - 3.3) < 1e-9 and c["prefill"]["node"] == "p1"
    st = svc.status()
    assert st["rejected"] == {} and st["admission"]["shadow_rejected"] == 1
    assert st["admission"]["shadow_rejected_by_reason"] == {"ttft_slo": 1}
    assert svc.admissions(["c"])["decisions"]["c"]["verdict"] == "shadow"
    assert svc.admissions(["a"])["decisions"]["a"]["verdict"] == "admit"


def test_off_checks_nothing():
    svc, (a, b, c) = _queue_three("off")
    assert a["ok"] and b["ok"] and c["ok"]
    assert svc.admissions()["shadow_rejected"] == 0 and svc.admissions()["admitted"] == 3


def test_default_model_does_not_reject_until_calibrated():
    """The built-in default model (another CPU's guess) decides as shadow until the prefill
    node's timed steps calibrated it; then it enforces, on the calibrated model."""
    s = settings("enforce", warmup=8)
    svc = ConductorService("c1", None, None, s, cost=default_cost_model(1000))
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    # the default predicts 0.05 + 6 ms a token: 600 tokens 3.65 s > 3 s SLO
    r = place(svc, "x", n=600)
    assert r["ok"] and svc.admissions(["x"])["decisions"]["x"]["verdict"] == "shadow"
    assert not svc.admissions(["x"])["decisions"]["x"]["calibrated"]
    # this machine is 3x faster: 2 ms a token. Eight timed prefill steps calibrate it.
    steps = [[n, 0, (0.05 + 0.006 * n) / 3] for n in (64, 128, 256, 512) * 2]
    report(svc, "p1", "prefill", arrived=["x"], prefill_steps=steps)
    st = svc.status()["cost_model"]
    assert st["calibrated"]["prefill"] and abs(st["scale"]["prefill"] - 1 / 3) < 1e-9
    assert abs(svc.cost.prefill_s(600, 0) - 3.65 / 3) < 1e-9
    r = place(svc, "y", n=600)               # 1.22 s now (x's prefill was reported done)
    assert r["ok"] and abs(r["predicted_ttft_s"] - 3.65 / 3) < 1e-9
    assert svc.admissions(["y"])["decisions"]["y"]["verdict"] == "admit"
    # a request the calibrated model predicts to miss even on this idle cluster is rejected
    # for real, as one no wait can help (HTTP 400 slo_unattainable, not a 429)
    r = place(svc, "z", n=6000)
    assert not r["ok"] and r["reason"] == "ttft_slo_unattainable"


def test_calibration_leaves_a_model_within_tolerance_alone():
    svc = ConductorService("c1", None, None, settings(), cost=COST)
    report(svc, "p1", "prefill")
    steps = [[n, 0, 1.1 * (0.1 + 0.01 * n)] for n in (50, 100, 200, 400)] * 2   # 10% slow
    report(svc, "p1", "prefill", prefill_steps=steps)
    st = svc.status()
    assert st["cost_model"]["scale"]["prefill"] == 1.0 and st["cost_model"]["calibrations"] == 0
    assert st["prefill_step_prediction"]["samples"] == CALIBRATE_EVERY
    assert abs(st["prefill_step_prediction"]["median_rel_error"] - (1 / 1.1 - 1)) < 1e-9


def test_decode_node_check_shadow_and_warmup():
    s = settings("shadow")
    adm = DecodeAdmission(s, 1000)
    adm.model.cost = COST                       # step with 200 requests: 2.06 s > 1 s SLO
    assert adm.check(199, 0, 0, "r1") is None and adm.refused == 0
    assert adm.ledger_view(["r1"])["decisions"]["r1"]["verdict"] == "shadow"
    assert adm.status()["shadow_rejected"] == 1
    # enforce on the built-in default: shadow until admission_warmup decode steps came in
    s = settings("enforce", warmup=8)
    adm = DecodeAdmission(s, 1000)
    adm.model.cost = default_cost_model(1000)  # 0.04 + 4 ms a sequence + 20 us a token
    assert adm.check(400, 0, 0, "r2") is None                   # 1.64 s predicted: shadow
    # measured steps: this node is 2x slower than the default says
    law = [(b, c, 2 * default_cost_model(1000).decode_step_s(b, c))
           for b, c in [(1, 100), (2, 300), (4, 900), (8, 2000)] * 2]
    adm.observe(law)
    assert adm.model.calibrated("decode")
    assert abs(adm.model.scale["decode"] - 2.0) < 1e-9
    refusal = adm.check(200, 0, 0, "r3")                        # 2 * 0.844 s: rejected now
    assert refusal is not None and abs(refusal["predicted_tbt_s"] - 2 * 0.844) < 1e-9
    assert adm.ledger_view()["decisions"]["r3"]["verdict"] == "reject" and adm.refused == 1


def test_prefills_queued_for_a_decode_node_count_only_when_their_decodes_overlap():
    """Issue 33's false rejections: six 1,000-token requests wait in one prefill queue
    (10.1 s each, first tokens 10.1 ... 60.6 s from now) for a decode node decoding one
    request. A seventh decodes from 70.7 s on, after the sixth's prefill and its own,
    when none of the six still decodes there (each decodes 10 tokens in under a second):
    its predicted step is that of 1 + 0 + 1 requests (0.07 s, within the 0.1 s TBT SLO;
    r0 counts, its end unknown), not 1 + 6 + 1 (0.13 s), and 2,500 free KV tokens hold
    it (1,010 tokens each), not beside all six."""
    s = settings("enforce", ttft_slo=100.0)
    s.conductor.tbt_slo_s = 0.1
    svc = ConductorService("c1", None, None, s, cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode", decode={"rids": ["r0"], "batch": 1, "context_tokens": 100,
                                        "free_kv_tokens": 2500})
    placed = [place(svc, f"q{i}", n=1000) for i in range(7)]
    assert all(p["ok"] for p in placed), placed[-1]
    assert [round(p["predicted_ttft_s"], 6) for p in placed] == \
        [round(10.1 * (i + 1), 6) for i in range(7)]
    assert abs(placed[-1]["predicted_tbt_s"] - (0.05 + 0.01 * 2)) < 1e-9
    assert svc.admissions()["rejected"] == 0 and svc.admissions()["shadow_rejected"] == 0
    # a short request on a second, idle prefill node decodes within the next second,
    # beside r0 alone (q0's decode starts at 10.1 s): a batch of 1 + 0 + 1
    report(svc, "p2", "prefill")
    r = place(svc, "now", n=10)
    assert r["ok"] and r["prefill"]["node"] == "p2"
    assert abs(r["predicted_tbt_s"] - (0.05 + 0.01 * 2)) < 1e-9


def test_a_calibration_while_requests_decode_does_not_skew_the_tbt_factor():
    """A burst: requests are admitted with steps the model predicts, the model is then
    calibrated 3.5x up (their steps measured 3.5x slower), and their TBTs come back at
    1.2x those measured steps. The factor is 1.2 against the model as it now is, not
    4.2 against the predictions made before the calibration (a fresh cluster refused
    every request, idle too, with 6.8). Ratios older than TBT_MAX_AGE_S no longer count:
    a check that refuses everything falls back to the steps' tail."""
    adm = DecodeAdmission(settings("enforce"), 1000)
    adm.model.cost = COST
    rids = [f"b{i}" for i in range(TBT_MIN_SAMPLES)]
    predicted = {}
    for rid in rids:
        assert adm.check(0, 0, 0, rid) is None
        predicted[rid] = COST.decode_step_s(1, 0)
    adm.observe([[1, 0, 3.5 * COST.decode_step_s(1, 0)]] * CALIBRATE_EVERY)
    assert adm.model.cost.decode_step_s(1, 0) == pytest.approx(3.5 * predicted["b0"])
    for rid in rids:
        gap = 1.2 * 3.5 * predicted[rid]
        adm.observe_tbt(rid, [0.0, gap])
    assert adm.model.tbt_factor() == pytest.approx(1.2)
    adm.model.tbt_ratios = type(adm.model.tbt_ratios)(
        ((x, at - TBT_MAX_AGE_S - 1) for x, at in adm.model.tbt_ratios),
        maxlen=adm.model.tbt_ratios.maxlen)
    assert adm.status()["tbt_factor"]["tbt_factor_from"] == "step tail"
    # a refusal tells the TBT that was set against the SLO: the step x the factor
    for i in range(TBT_MIN_SAMPLES):                            # TBTs 3x their steps
        assert adm.check(0, 0, 0, f"s{i}") is None
        adm.observe_tbt(f"s{i}", [0.0, 3.0 * adm.model.cost.decode_step_s(1, 0)])
    refusal = adm.check(9, 0, 0, "over")                        # 3 x 0.525 s > 1 s
    step = adm.model.cost.decode_step_s(10, 0)
    assert refusal is not None and refusal["predicted_tbt_s"] == pytest.approx(3.0 * step)
    assert f"{3.0 * step:.3f} s (step {step:.3f} s x TBT factor 3.00)" in refusal["error"]


def test_the_node_check_counts_the_requests_still_decoding_when_the_request_starts():
    """The decode node's TBT check: a request admitted before its prefill starts to decode
    after it, predicted from the recent admissions' seconds per prompt token (admission
    to arrival); the running requests count only while their output tokens left reach
    past that start at the step time now."""
    adm = DecodeAdmission(settings("enforce"), 1000)
    assert adm.starts_in_s(200) == 0.0          # nothing observed: every running one counts
    for i in range(START_DELAY_MIN_SAMPLES):
        adm.observe_start(100, 0.4 + 0.02 * i)  # 4.0 ... 5.4 ms a token
    assert adm.starts_in_s(200) == pytest.approx(200 * 0.0047)
    # at 10 ms a step: 10 tokens left end in 0.1 s, 1,000 in 10 s, unknown: counted
    running = [(100, 10), (200, 1000), (50, None)]
    assert still_decoding(running, 0.01, 0.94) == (2, 250)
    assert still_decoding(running, 0.01, 0.0) == (3, 350)
    assert still_decoding([], 0.01, 1.0) == (0, 0)


def test_metrics_export_verdicts_scales_and_errors():
    from types import SimpleNamespace

    from mooncaked.cluster.node_metrics import NodeCollector

    svc, _ = _queue_three("shadow")
    report(svc, "p1", "prefill", prefill_steps=[[n, 0, 2 * (0.1 + 0.01 * n)]
                                                for n in (50, 100, 200, 400) * 2])
    fams = {f.name: f for f in NodeCollector(SimpleNamespace(conductor=svc, decode=None))
            ._admission()}
    got = {tuple(s.labels.values()): s.value
           for f in fams.values() for s in f.samples}
    assert got[("conductor", "admit")] == 2 and got[("conductor", "shadow")] == 1
    assert got[("conductor", "prefill")] == pytest.approx(2.0)          # calibrated 2x
    assert got[("conductor", "prefill_step")] == pytest.approx(0.5)    # |1 - 2| / 2


def test_ctl_status_prints_calibration_and_admission(capsys):
    from mooncaked.cli.ctl import _print_conductor

    svc, _ = _queue_three("shadow")
    _print_conductor(svc.status())
    out = capsys.readouterr().out
    assert "admission: shadow, admitted 2, rejected 0, shadow-rejected 1 (ttft_slo 1)" in out
    assert "calibration: prefill x1 from 0 steps, decode x1 from 0 steps" in out
    assert "TBT factor: x1 from step tail (0 observed TBTs in the last minute)" in out
    assert "prefill step - over 0 steps" in out


def test_a_calibrated_default_is_kept_per_machine_and_enforces_at_the_next_start(tmp_path):
    """The built-in default, calibrated from served steps, is saved under the state dir
    keyed by the model nodes' CPU, model and dtype (calibration_cache.py); a conductor
    started later on the same hardware loads it and enforces at once; other hardware
    starts from the default again, in shadow."""
    info = {"cpu": "AMD EPYC test", "model_id": "smol", "dtype": "float32",
            "block_bytes": 16 * 1000, "block_size": 16}

    def conductor(model_info: dict) -> ConductorService:
        s = settings("enforce", warmup=8)
        s.node.state_dir = str(tmp_path)
        svc = ConductorService("c1", None, None, s)
        svc._upsert("p1", {"role": "prefill", "model": model_info})
        svc._upsert("d1", {"role": "decode", "model": model_info})
        report(svc, "p1", "prefill")
        report(svc, "d1", "decode")
        return svc

    svc = conductor(info)
    svc._cost()                                       # the default: nothing cached yet
    assert svc.cost.meta["source"] == "default" and not svc.model.calibrated("prefill")
    default = default_cost_model(1000)
    report(svc, "p1", "prefill", prefill_steps=[[n, 0, 0.5 * default.prefill_s(n, 0)]
                                                for n in (64, 128, 256, 512) * 2])
    report(svc, "d1", "decode", decode_steps=[[b, 100 * b, 3 * default.decode_step_s(b, 100 * b)]
                                              for b in (1, 2, 3, 4) * 2])
    saved = list((tmp_path / "cost_models").glob("calibrated-*.json"))
    assert len(saved) == 1
    again = conductor(info)
    cost = again._cost()
    assert cost.meta["source"] == "calibrated" and again.model.calibrated("prefill")
    assert abs(cost.prefill_s(300, 0) - 0.5 * default.prefill_s(300, 0)) < 1e-9
    assert abs(cost.decode_step_s(2, 200) - 3 * default.decode_step_s(2, 200)) < 1e-9
    assert "calibrated cache" in again.status()["cost_model"]["meta"]["origin"]
    other = conductor({**info, "cpu": "another CPU"})
    assert other._cost().meta["source"] == "default"


def test_tbt_check_predicts_the_tail_of_the_gaps_not_the_median_step():
    """The SLO is on the paper's TBT (mean of the longest 10% gaps). 36 of 40 steps take
    what COST predicts and 4 take 3x (a slow step now and then, as on a shared machine):
    the tail factor is mean(top 10% of measured/predicted) / median = 3, so a request
    whose predicted step is 0.45 s is a TBT miss against a 1 s SLO (3 x 0.45 = 1.35 s)."""
    steps = [[b, 0, COST.decode_step_s(b, 0) * (3.0 if i % 10 == 9 else 1.0)]
             for i, b in enumerate([1, 2, 3, 4] * 10)]
    adm = DecodeAdmission(settings("enforce"), 1000)
    adm.model.cost = COST
    assert adm.check(39, 0, 0, "before") is None                # 0.45 s: fine by the median
    adm.observe(steps)
    assert adm.model.tbt_factor() == pytest.approx(3.0)
    assert adm.model.scale["decode"] == 1.0                   # the median is right: no scaling
    refusal = adm.check(39, 0, 0, "after")
    # what it tells is what it set against the SLO: the step x the factor
    assert refusal is not None and refusal["predicted_tbt_s"] == pytest.approx(3 * 0.45)
    # the conductor decides the same from the same steps
    svc = ConductorService("c1", None, None, settings("enforce", ttft_slo=100.0), cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode", decode={"rids": [], "batch": 39, "context_tokens": 0,
                                        "free_kv_tokens": 10_000})
    assert place(svc, "a")["ok"]
    report(svc, "d1", "decode", decode_steps=steps, decode={
        "rids": [], "batch": 39, "context_tokens": 0, "free_kv_tokens": 10_000})
    r = place(svc, "b")
    assert not r["ok"] and r["reason"] == "tbt_slo"
    assert svc.status()["cost_model"]["tbt_factor"] == pytest.approx(3.0)


def test_the_tbt_factor_comes_from_the_tbts_streams_saw_once_enough_reported():
    """The TBT a client sees holds gaps no engine step has (the hand-over, event loops, a
    shared core). Once TBT_MIN_SAMPLES admitted requests reported the TBT their stream
    sent them with (the decode node's writes; the API node's, in NodeReport.tbts), the
    factor is their median observed TBT / the step predicted at admission: here 1.2,
    which overrides the steps' tail (3.0) and admits a request that tail refused."""
    steps = [[b, 0, COST.decode_step_s(b, 0) * (3.0 if i % 10 == 9 else 1.0)]
             for i, b in enumerate([1, 2, 3, 4] * 10)]
    adm = DecodeAdmission(settings("enforce"), 1000)
    adm.model.cost = COST
    adm.observe(steps)
    assert adm.model.tbt_factor() == pytest.approx(3.0)
    assert adm.check(39, 0, 0, "tail-refused") is not None       # 3 x 0.45 s > 1 s
    for i in range(TBT_MIN_SAMPLES):
        rid = f"r{i}"
        assert adm.check(i, 0, 0, rid) is None                    # step 0.06 + 0.01 i s
        gap = 1.2 * COST.decode_step_s(i + 1, 0)
        times = [0.0, gap / 2, gap, 2 * gap, 2.5 * gap]           # longest gap: 1.2 x step
        assert adm.model.tbt_factor() == pytest.approx(3.0)       # not enough TBTs yet
        adm.observe_tbt(rid, times)
    adm.observe_tbt("never-admitted", [0.0, 50.0])                # ignored
    adm.observe_tbt("tail-refused", [0.0, 50.0])                  # refused: no prediction
    assert adm.model.tbt_factor() == pytest.approx(1.2)
    st = adm.status()["tbt_factor"]
    assert st["tbt_factor_from"] == "observed TBTs" and st["observed_tbts"] == TBT_MIN_SAMPLES
    assert adm.check(39, 0, 0, "now-admitted") is None            # 1.2 x 0.45 s < 1 s
    assert adm.check(80, 0, 0, "still-refused") is not None       # 1.2 x 0.86 s > 1 s
    # the conductor: the step it predicted at placement, the TBT the API node saw
    svc = ConductorService("c1", None, None, settings("enforce", ttft_slo=100.0), cost=COST)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode", decode_steps=steps)
    replies = {f"q{i}": place(svc, f"q{i}") for i in range(TBT_MIN_SAMPLES)}
    assert all(r["ok"] for r in replies.values())
    assert svc.status()["cost_model"]["tbt_factor"] == pytest.approx(3.0)
    report(svc, "c0", "cache", tbts=[[rid, 1.5 * r["predicted_tbt_s"]]
                                     for rid, r in replies.items()])
    assert svc.status()["cost_model"]["tbt_factor"] == pytest.approx(1.5)
    assert svc.status()["cost_model"]["tbt_factor_from"] == "observed TBTs"
