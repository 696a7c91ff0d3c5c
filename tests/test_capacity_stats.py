"""`bench capacity`'s admission figures and bootstrap intervals (benchmarks/capacity_stats.py,
issue 33) on constructed records and ledgers, and its helpers that need no cluster."""

from __future__ import annotations

import dataclasses

import pytest

from mooncaked.benchmarks.capacity import _all_within, _best_chunk, main, overrides
from mooncaked.benchmarks.capacity_stats import (admission_figures, capacity_of,
                                                 capacity_ratio_ci, met_slo, ratio_of, refine_rate,
                                                 share_ci)
from mooncaked.replay.runner import RequestRecord


def rec(rid: str, ttft: float | None, tbt: float | None,
        gaps: tuple[float, ...] = (0.1, 0.1, 0.1),
        ok: bool = True, rejected: bool = False) -> RequestRecord:
    times = [ttft or 0.0]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index=0, scheduled_s=0.0, sent_prompt_tokens=100, max_tokens=3,
                         ok=ok, rejected=rejected, ttft_s=ttft, tbt_s=tbt,
                         token_times_s=times if ok else [], request_id=rid)


def test_met_slo():
    assert met_slo(rec("a", 1.0, 0.2), 2.0, 0.3)
    assert not met_slo(rec("a", 3.0, 0.2), 2.0, 0.3)
    assert not met_slo(rec("a", 1.0, 0.4), 2.0, 0.3)
    assert not met_slo(rec("a", None, None, ok=False, rejected=True), 2.0, 0.3)


def test_admission_figures_count_false_rejections_and_misses():
    records = [rec("a", 1.0, 0.2),              # admitted, met: fine
               rec("b", 1.5, 0.25),             # shadow-rejected but met: false rejection
               rec("c", 5.0, 0.2),              # shadow-rejected and missed: right call
               rec("d", 4.0, 0.2),              # admitted and missed (TTFT): a miss
               rec("e", 1.0, 0.2, gaps=(0.2, 0.2, 0.2)),   # the node's check shadow-rejected it
               rec("f", None, None, ok=False, rejected=True)]    # rejected for real
    decisions = {
        "a": [{"verdict": "admit", "predicted_ttft_s": 2.0, "predicted_tbt_s": 0.1}],
        "b": [{"verdict": "shadow", "predicted_ttft_s": 3.0, "predicted_tbt_s": 0.1}],
        "c": [{"verdict": "shadow", "predicted_ttft_s": 5.0, "predicted_tbt_s": 0.15}],
        "d": [{"verdict": "admit", "predicted_ttft_s": 1.0, "predicted_tbt_s": 0.1}],
        "e": [{"verdict": "admit", "predicted_ttft_s": 1.0, "predicted_tbt_s": 0.1},
              {"verdict": "shadow", "predicted_ttft_s": None, "predicted_tbt_s": 0.5}]}
    f = admission_figures(records, decisions, ttft_slo=2.0, tbt_slo=0.3)
    assert f["with_decision"] == 6
    assert f["would_reject"] == 4                   # b, c, e (shadow) and f (rejected)
    assert f["refused_unknown"] == 1                # f never ran
    assert f["rejections_judged"] == 3
    assert f["false_rejections"] == 2               # b and e met both SLOs
    assert f["admitted_misses"] == 1                # d
    # 2 of the 3 that ran were false: the 4 would-be rejections hold 8/3 false ones
    assert f["false_rejection_share"] == pytest.approx(2 / 3 * 4 / 6, abs=1e-4)
    assert f["false_rejection_share_at_most"] == pytest.approx(3 / 6, abs=1e-4)   # f too
    # TTFT errors |p - o| / o: a 1.0, b 1.0, c 0.0, d 0.75, e 0.0 -> median 0.75
    assert f["ttft_pred_mare"] == 0.75 and f["ttft_pred_pairs"] == 5
    # step: the first decision with a prediction against the median gap: a 0, b 0, c 0.5,
    # d 0, e |0.1 - 0.2| / 0.2 = 0.5 -> median 0
    assert f["step_pred_mare"] == 0.0 and f["step_pred_pairs"] == 5


def test_refusals_leave_false_rejections_unknown_and_short_requests_no_step_error():
    """Enforcing, a refused request never ran: its outcome, so the false rejections, is
    unknown (None, not 0). A request's first gap (the hand-over) is not a step: a 2-token
    request whose tokens arrived in one read once gave a step error of 270x."""
    records = [rec("a", 1.0, 0.2), rec("f", None, None, ok=False, rejected=True),
               rec("g", 1.0, 0.0, gaps=(0.00001,)), rec("h", 1.0, 0.1, gaps=(0.3, 0.1, 0.1))]
    decisions = {r: [{"verdict": "admit", "predicted_ttft_s": 1.0, "predicted_tbt_s": 0.1}]
                 for r in ("a", "g", "h")}
    f = admission_figures(records, decisions, ttft_slo=2.0, tbt_slo=0.3)
    assert f["would_reject"] == 1 and f["refused_unknown"] == 1
    assert f["false_rejections"] is None and f["false_rejection_share"] is None
    assert f["false_rejection_share_at_most"] == 0.25       # the refusal, counted false
    assert f["step_pred_pairs"] == 2 and f["step_pred_mare"] == 0.0     # a and h, not g
    # a refusal that every check on record admitted (a full receive buffer's 429) is no
    # admission rejection: an admitted miss
    i = rec("i", None, None, ok=False, rejected=True)
    f = admission_figures([*records, i], {**decisions, "i": decisions["a"]}, 2.0, 0.3)
    assert f["would_reject"] == 1 and f["admitted_misses"] == 1
    # nothing refused or shadowed: no false rejection, known
    f = admission_figures(records[:1], decisions, ttft_slo=2.0, tbt_slo=0.3)
    assert f["false_rejections"] == 0 and f["false_rejection_share"] == 0.0


def test_a_holdout_stands_for_the_refusals_it_could_have_admitted():
    """Held out while enforcing: 1 of 2 judged met the SLOs; 2 more were refused with 429
    and 1 with a 400 slo_unattainable, which no holdout admits: 1/2 x (5 - 1) = 2 of 10
    requests would have been refused falsely, at most 1 + 3."""
    shadow = [{"verdict": "shadow", "predicted_ttft_s": 3.0, "predicted_tbt_s": 0.1,
               "held_out": True}]
    reject = [{"verdict": "reject", "predicted_ttft_s": 3.0, "predicted_tbt_s": 0.1}]
    records = [rec("h1", 1.0, 0.2), rec("h2", 5.0, 0.2),
               rec("r1", None, None, ok=False, rejected=True),
               rec("r2", None, None, ok=False, rejected=True),
               dataclasses.replace(rec("u", None, None, ok=False, rejected=True), status=400),
               *(rec(f"a{k}", 1.0, 0.2) for k in range(5))]
    decisions = {"h1": shadow, "h2": shadow, "r1": reject, "r2": reject, "u": reject,
                 **{f"a{k}": [{"verdict": "admit", "predicted_ttft_s": 1.0,
                               "predicted_tbt_s": 0.1}] for k in range(5)}}
    f = admission_figures(records, decisions, ttft_slo=2.0, tbt_slo=0.3)
    assert (f["would_reject"], f["refused_unknown"], f["refused_unattainable"],
            f["rejections_judged"], f["false_rejections"]) == (5, 3, 1, 2, 1)
    assert f["false_rejection_share"] == pytest.approx(0.2)
    assert f["false_rejection_share_at_most"] == pytest.approx(0.4)


def test_share_ci_brackets_the_share_and_narrows_with_more_requests():
    few = share_ci([1] * 8 + [0] * 2)
    many = share_ci([1] * 80 + [0] * 20)
    assert few[0] <= 0.8 <= few[1] and many[0] <= 0.8 <= many[1]
    assert many[1] - many[0] < few[1] - few[0]
    assert share_ci([1] * 10) == [1.0, 1.0] and share_ci([]) is None


def test_capacity_ratio_ci():
    assert capacity_of({0.1: 1.0, 0.2: 0.95, 0.4: 0.5}, 0.9) == 0.2
    assert capacity_of({0.1: 0.5}, 0.9) is None
    assert ratio_of(0.4, 0.2, [0.1, 0.2, 0.4]) == 2.0
    assert ratio_of(0.4, None, [0.1, 0.2, 0.4]) == 4.0        # coupled below every rate
    assert ratio_of(None, 0.2, [0.1]) == 0.0
    # pd passes everywhere (60 of 60), coupled only at 0.1: the ratio is 4 in every resample
    flags = {("pd", r): [1] * 60 for r in (0.1, 0.2, 0.4)}
    flags |= {("coupled", 0.1): [1] * 60, ("coupled", 0.2): [0] * 60,
              ("coupled", 0.4): [0] * 60}
    assert capacity_ratio_ci(flags, 0.9, n=200) == [4.0, 4.0]
    # coupled at 0.2 is at 90% exactly: about half the resamples pass it -> ratio 2 or 4
    flags[("coupled", 0.2)] = [1] * 54 + [0] * 6
    lo, hi = capacity_ratio_ci(flags, 0.9, n=400)
    assert (lo, hi) == (2.0, 4.0)
    assert capacity_ratio_ci({("pd", 0.1): [1]}, 0.9) is None


def test_refine_rate_halves_the_capacity_bracket_on_a_log_scale():
    # passes 1.0, fails 2.0: the next rate is their geometric midpoint
    assert refine_rate({0.5: 1.0, 1.0: 0.95, 2.0: 0.6}, 0.9) == pytest.approx(2 ** 0.5)
    # then between sqrt(2) (passed) and 2 -> 2^0.75; a failed midpoint narrows from above
    assert refine_rate({1.0: 0.95, 2 ** 0.5: 0.92, 2.0: 0.6}, 0.9) == pytest.approx(2 ** 0.75)
    assert refine_rate({1.0: 0.95, 2 ** 0.5: 0.5, 2.0: 0.6}, 0.9) == pytest.approx(2 ** 0.25)
    # a bracket within 1.2x is resolved; a side below every rate halves the lowest; a side
    # passing every rate doubles the highest; nothing measured gives nothing
    assert refine_rate({1.0: 0.95, 1.15: 0.5}, 0.9) is None
    assert refine_rate({0.6: 0.88, 1.2: 0.4}, 0.9) == pytest.approx(0.3)
    assert refine_rate({0.6: 1.0, 1.2: 0.95}, 0.9) == pytest.approx(2.4)
    assert refine_rate({}, 0.9) is None
    # a non-monotone sweep: the capacity is the highest passing rate, the bracket above it
    assert refine_rate({0.5: 0.8, 1.0: 0.95, 4.0: 0.1}, 0.9) == pytest.approx(2.0)


def test_best_chunk_and_overrides():
    by = {128: [{"side": "coupled", "rate": 0.1, "share_within_slo": 1.0},
                {"side": "coupled", "rate": 0.2, "share_within_slo": 0.95}],
          512: [{"side": "coupled", "rate": 0.1, "share_within_slo": 1.0},
                {"side": "coupled", "rate": 0.2, "share_within_slo": 0.5}]}
    assert _best_chunk(by) == 128
    assert overrides(["conductor.refit_cost_model=false", "x.y=2", "z=abc"]) == {
        "conductor.refit_cost_model": False, "x.y": 2, "z": "abc"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        overrides(["nope"])


def test_targets_not_measured_are_none_and_bad_arguments_fail_before_any_node(tmp_path, capsys):
    """A target with nothing to judge it on is None, not True; a missing trace, an empty
    slice, or both SLOs without --rates stop at once with argparse's one-line error."""
    adm = {"false_rejection_share": None, "admitted_miss_share": 0.02}
    assert _all_within([], "false_rejection_share") is None
    assert _all_within([{"admission": adm}], "false_rejection_share") is None
    assert _all_within([{"admission": adm}], "admitted_miss_share") is True
    assert _all_within([{"admission": {**adm, "admitted_miss_share": 0.1}}],
                       "admitted_miss_share") is False
    for argv, says in ((["--traces", str(tmp_path / "none.jsonl")], "no such trace file"),
                       (["--limit", "0"], "at least one request"),
                       (["--holdout-share", "0"], "a share in (0, 1]"),
                       (["--ttft-slo", "2", "--tbt-slo", "0.05"], "give --rates")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "out")])
        assert e.value.code == 2 and says in capsys.readouterr().err
        assert not (tmp_path / "out").exists()          # nothing created
