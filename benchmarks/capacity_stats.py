"""`bench capacity`'s figures beyond the share within SLO (issue 33): admission against
what happened, and bootstrap confidence intervals. Pure functions over the replay's
records and the nodes' admission ledgers (conductor/admission_ledger.py); no I/O.

Admission, per rate, from a run whose checks were in shadow mode (or enforcing: then a
rejected request cannot tell whether it would have met the SLOs):

- would_reject: requests a check rejected or would have rejected (shadow); a refusal
  no check decided (a 429 for full receive buffers: the ledgers admitted it) is an
  admitted miss instead; one without any decision on record (no request id) counts;
- refused_unknown: of those, the ones refused (enforce), whose outcome is unknown;
- refused_unattainable: of those, the 400s slo_unattainable (a prompt over the TTFT SLO
  even on an idle cluster), which no holdout admits;
- rejections_judged: of those, the ones that ran (shadow, or held out while enforcing);
- false_rejections: of those that ran (shadow, or held out while enforcing), the ones
  that met both SLOs (None when none ran: every would-be rejection was refused);
- false_rejection_share: the share of the rate's requests a check that refused every
  would-be rejection would have refused falsely: false_rejections / ran x (would_reject
  - refused_unattainable) / requests (in shadow mode, where all ran, false_rejections /
  requests; with a holdout, the ones held out stand for the ones refused that a holdout
  could have admitted); None when none ran;
- false_rejection_share_at_most: (false_rejections + refused_unknown) / requests: the
  most a check refusing every would-be rejection could refuse falsely, whatever the
  refused would have done (each counted false); in an enforcing run without a holdout,
  about its refusals / requests;
- admitted_misses: requests every check admitted that missed an SLO (or failed);
- ttft_pred_mare: median |predicted - observed| / observed TTFT (the conductor's
  prediction at placement against the client's TTFT);
- step_pred_mare: the same for the decode step time (the prediction of the step with
  the request admitted against the request's median inter-token gap after the first,
  over requests with at least MIN_STEADY_GAPS such gaps).

Refinement: a grid of rates fixes the ratio's resolution (with rates 0.5x, 1x, 2x apart
the ratio is 1 or 2, never 1.4); `refine_rate` picks the next rate that halves a side's
capacity bracket (on a log scale), so a few more rates resolve it.

Intervals: a share within SLO is resampled per request (`share_ci`); `capacity_ratio`
by resampling every (rate, side)'s requests together and recomputing both capacities
(`capacity_ratio_ci`), percentile intervals.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mooncaked.replay.runner import RequestRecord

LEVEL = 0.9                 # two-sided confidence level of the intervals
BOOTSTRAP = 2000            # resamples


def met_slo(r: RequestRecord, ttft_slo: float, tbt_slo: float) -> bool:
    """Whether a request completed within both SLOs (a rejected or failed one did not)."""
    return bool(r.ok and r.ttft_s is not None and r.ttft_s <= ttft_slo
                and (r.tbt_s is None or r.tbt_s <= tbt_slo))


MIN_STEADY_GAPS = 2         # gaps after the first a request needs for a step-error sample


def _median_gap(r: RequestRecord) -> float | None:
    """The median of a request's gaps after its first (the first is the hand-over, which
    can be a whole queue wait or, when the first two tokens arrive in one read, about 0:
    a 2-token request once gave a step error of 270x); None with fewer than
    MIN_STEADY_GAPS of them."""
    gaps = [b - a for a, b in itertools.pairwise(r.token_times_s)][1:]
    return statistics.median(gaps) if len(gaps) >= MIN_STEADY_GAPS else None


def _mare(pairs: list[tuple[float, float]]) -> float | None:
    errs = [abs(p - o) / o for p, o in pairs if o > 0]
    return round(statistics.median(errs), 4) if errs else None


def admission_figures(records: Sequence[RequestRecord],
                      decisions: Mapping[str, Sequence[Mapping[str, Any]]],
                      ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """The admission figures of one rate (see the module doc).

    Args:
        records: the replay's records; `request_id` joins them to the decisions.
        decisions: request id -> the ledger entries every check made for it (conductor,
            node), each {"verdict": admit|reject|shadow, "predicted_ttft_s",
            "predicted_tbt_s", ...} (None predictions allowed).
        ttft_slo, tbt_slo: seconds.
    """
    would, false_rej, misses, known, refused, hopeless = 0, 0, 0, 0, 0, 0
    ttft_pairs, step_pairs = [], []
    for r in records:
        ds = decisions.get(r.request_id or "", ())
        if not ds and not r.rejected:
            continue
        known += 1
        # a refusal counts when a check decided it, or when no decision is on record
        refused_by_check = r.rejected and (not ds or any(d.get("verdict") == "reject"
                                                         for d in ds))
        rejecting = refused_by_check or any(d.get("verdict") in ("reject", "shadow")
                                            for d in ds)
        ok = met_slo(r, ttft_slo, tbt_slo)
        if rejecting:
            would += 1
            false_rej += ok
            refused += r.rejected      # never ran: whether it would have met is unknown
            hopeless += r.rejected and r.status == 400      # slo_unattainable: no holdout
        elif not ok:
            misses += 1
        ttft = next((d["predicted_ttft_s"] for d in ds if d.get("predicted_ttft_s")), None)
        if ttft is not None and r.ttft_s:
            ttft_pairs.append((ttft, r.ttft_s))
        step = next((d["predicted_tbt_s"] for d in ds if d.get("predicted_tbt_s")), None)
        gap = _median_gap(r) if r.ok else None
        if step is not None and gap:
            step_pairs.append((step, gap))
    n = len(records)
    # a check that refused (enforce) leaves its rejections' outcomes unknown: the count
    # is over the would-be rejections that ran (shadow or holdout), None when none of
    # them ran; the share scales their false ones up to every would-be rejection
    ran = would - refused
    judged = ran > 0 or not would               # some would-be rejection ran, or none
    share = false_rej / ran * (would - hopeless) / n if n and ran else 0.0
    return {"with_decision": known, "would_reject": would, "refused_unknown": refused,
            "refused_unattainable": hopeless, "rejections_judged": ran,
            "false_rejections": false_rej if judged else None,
            "false_rejection_share": round(share, 4) if n and judged else None,
            "false_rejection_share_at_most": round((false_rej + refused) / n, 4) if n else None,
            "admitted_misses": misses,
            "admitted_miss_share": round(misses / n, 4) if n else None,
            "ttft_pred_mare": _mare(ttft_pairs), "ttft_pred_pairs": len(ttft_pairs),
            "step_pred_mare": _mare(step_pairs), "step_pred_pairs": len(step_pairs)}


def _interval(xs: list[float], level: float = LEVEL) -> list[float]:
    xs = sorted(xs)
    lo = xs[int((1 - level) / 2 * (len(xs) - 1))]
    hi = xs[int((1 + level) / 2 * (len(xs) - 1))]
    return [round(lo, 4), round(hi, 4)]


def share_ci(flags: Sequence[int], seed: int = 0, n: int = BOOTSTRAP) -> list[float] | None:
    """Bootstrap percentile interval (LEVEL) of the share of 1s in `flags` (a request
    within SLO: 1, else 0); None for no requests."""
    if not flags:
        return None
    rng = random.Random(seed)
    k = len(flags)
    return _interval([sum(rng.choices(flags, k=k)) / k for _ in range(n)])


def capacity_of(shares: Mapping[float, float], pass_share: float) -> float | None:
    """The highest rate whose share is >= pass_share (None when none is)."""
    ok = [rate for rate, s in shares.items() if s >= pass_share]
    return max(ok) if ok else None


RESOLUTION = 1.2           # a capacity bracket this narrow (next fail / last pass) is final


def refine_rate(shares: Mapping[float, float], pass_share: float) -> float | None:
    """The next arrival rate to measure on a side to narrow its capacity, as DistServe's
    goodput search does, but one rate a step: the geometric midpoint of its bracket (the
    highest passing rate and the lowest failing rate above it); half the lowest rate when
    it passes none; twice the highest when it passes them all.

    Args:
        shares: rate (req/s) -> share of requests within both SLOs, the rates measured so far.
        pass_share: a rate passes when its share reaches this.
    Returns: req/s, or None when the bracket is already within RESOLUTION (or no rates).
    """
    if not shares:
        return None
    rates = sorted(shares)
    cap = capacity_of(shares, pass_share)
    if cap is None:
        return rates[0] / 2
    above = [r for r in rates if r > cap]
    if not above:
        return rates[-1] * 2
    if above[0] / cap <= RESOLUTION:
        return None
    return math.sqrt(cap * above[0])


def ratio_of(pd: float | None, coupled: float | None, rates: Sequence[float]) -> float:
    """pd capacity / coupled capacity; a side below every rate counts as 0 (pd) or, for
    coupled, as the lowest rate (a lower bound on the ratio, as the benchmark reports)."""
    if not pd:
        return 0.0
    return pd / (coupled if coupled else min(rates))


def capacity_ratio_ci(flags: Mapping[tuple[str, float], Sequence[int]], pass_share: float,
                      seed: int = 0, n: int = BOOTSTRAP,
                      ratio: Callable[..., float] = ratio_of) -> list[float] | None:
    """Bootstrap percentile interval (LEVEL) of pd capacity / coupled capacity.

    Args:
        flags: (side, rate) -> per-request within-SLO flags, for sides "pd" and "coupled".
        pass_share: a rate passes when its share within SLO reaches this.
    Returns: [low, high], or None without both sides."""
    sides = {s for s, _ in flags}
    if not {"pd", "coupled"} <= sides:
        return None
    rates = sorted({r for _, r in flags})
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cap = {}
        for side in ("pd", "coupled"):
            shares = {}
            for rate in rates:
                f = flags.get((side, rate))
                if f:
                    shares[rate] = sum(rng.choices(f, k=len(f))) / len(f)
            cap[side] = capacity_of(shares, pass_share)
        out.append(ratio(cap["pd"], cap["coupled"], rates))
    return _interval(out)


__all__ = ["BOOTSTRAP", "LEVEL", "admission_figures", "capacity_of", "capacity_ratio_ci",
           "met_slo", "ratio_of", "refine_rate", "share_ci"]
