"""The conductor's live cost model: its predictions scored against what the nodes
report, and refitted from what they measure (Mooncake paper, section 5: the cost
model drives placement, so it must track the hardware).

`CostModelRefitter` holds the model. It calibrates fast, then refits:

- calibration: every timed engine step (a prefill node's prefill steps: new and
  cached tokens of the step's chunks; a decode node's decode steps) is set against
  the model's prediction; after each `CALIBRATE_EVERY` steps of a kind whose median
  ratio observed / predicted is off by more than `CALIBRATE_TOLERANCE`, that
  polynomial is scaled by the ratio. A model from another CPU (or the built-in
  default) is right within a few seconds of serving, before any refit could run. A
  model node's start-up profile (engine/startup_profile.py) arrives the same way before
  it serves (source STARTUP_PROFILE; the conductor takes it from the node's member
  record), so the built-in default is calibrated before the first request;
- refit: finished prefills that ran alone on their node and the prefill steps refit
  the prefill polynomial; timed decode steps refit the decode-step model, and a
  start-up profile's batches of 1 to 8 fit its fixed and per-sequence costs at once
  (`fit_decode_profile`: calibration alone keeps the default's shape); a refit
  replaces the model only when it predicts the recent samples 20% better and has no
  negative coefficient;
- TBT: admission multiplies the predicted step by `tbt_factor`, learned from the TBT
  each finished request's stream saw (the API node's for the conductor, the decode
  node's writes for its own check) over the step predicted when it was admitted.

`conductor.refit_cost_model = false` keeps the loaded model fixed (no calibration
either); predictions are still scored. `calibrated(kind)` says whether admission may
enforce on the model (conductor/admission_ledger.py): a model that did not come from
the built-in default, or one calibrated from `conductor.admission_warmup` steps.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from mooncaked.wire.messages import PrefillDone
from mooncaked.config import Settings
from mooncaked.log import get_logger

from .cost_model import DECODE_TERMS, CostModel, PolyModel

log = get_logger(__name__)

REFIT_MIN_SAMPLES = 16      # prefill samples (run alone on their node) before a refit is tried
ERROR_WINDOW = 200          # prediction errors kept for `status()`
CALIBRATE_EVERY = 8         # timed steps of a kind between two calibrations
CALIBRATE_TOLERANCE = 0.15  # a median observed/predicted ratio within 1 +- this is left alone
TAIL_MIN_STEPS = 20         # timed decode steps before the TBT tail factor departs from 1
OVERHEAD_MIN_SAMPLES = 8    # observed TTFTs before the learned TTFT overhead departs from 0
TBT_MIN_SAMPLES = 8         # observed request TBTs before they set the TBT factor
TBT_WINDOW = 64             # the recent request TBTs the factor is the median of
TBT_MAX_AGE_S = 60.0        # ... observed within this many seconds (else the step-tail factor)
SERVED = "served steps"     # where a timed step came from: a request the node served,
STARTUP_PROFILE = "startup profile"   # or its start-up profile (engine/startup_profile.py)


def scaled(m: PolyModel, factor: float) -> PolyModel:
    """`m` with every coefficient multiplied by `factor` (> 0): the same shape, predicting
    `factor` times the time."""
    return PolyModel(m.terms, tuple(c * factor for c in m.coef))


def ttft_overhead_s(gaps: Sequence[float], min_samples: int = OVERHEAD_MIN_SAMPLES) -> float:
    """The time a request's TTFT spends outside the engine steps the cost model predicts
    (the RPCs, waiting on the node before its step, the KV push tail, tokenization, the
    first token's trip back), learned from `gaps`: each a placed request's observed TTFT
    (at its API node) minus the TTFT the conductor predicted for it, seconds. Their median,
    not below 0 (over-predicted compute is the calibration's to fix, not a negative
    overhead); 0 with fewer than `min_samples` gaps."""
    if len(gaps) < max(1, min_samples):
        return 0.0
    return max(0.0, statistics.median(gaps))


def _refit(current: PolyModel, samples: Any, terms: Any, nonnegative: bool = False
           ) -> tuple[PolyModel, dict] | None:
    """A PolyModel fitted to (x1, x2, seconds) samples, with its provenance, when it beats
    `current` on them by 20% in mean relative error; else None. Never a fit that predicts
    <= 0 at the largest observed (x1, x2), nor (nonnegative) one with a negative
    coefficient: live samples move together (batch and context grow alike), so a fit can
    look good on them and still go negative elsewhere."""
    x1, x2, y = zip(*samples)
    try:
        new = PolyModel.fit(x1, x2, y, tuple(terms))
    except ValueError:
        return None
    info = _accepted(current, new, samples, nonnegative)
    return None if info is None else (new, info)


def _accepted(current: PolyModel, new: PolyModel, samples: Any, nonnegative: bool
              ) -> dict | None:
    """`new`'s provenance when it may replace `current` (see `_refit`: 20% better on the
    samples, positive at their largest point, no negative coefficient with nonnegative),
    else None."""
    x1, x2, _ = zip(*samples)
    if new(max(x1), max(x2)) <= 0 or (nonnegative and min(new.coef) < 0):
        return None

    def err(m) -> float:
        return statistics.fmean(abs(max(0.0, m(a, b)) - t) / t for a, b, t in samples)

    old_err, new_err = err(current), err(new)
    if new_err >= 0.8 * old_err:
        return None
    return {"samples": len(samples), "mean_rel_error": round(new_err, 4),
            "previous_mean_rel_error": round(old_err, 4)}


class CostModelRefitter:
    """The live cost model and its prediction errors (see the module doc).

    Args:
        settings: conductor.refit_cost_model switches refits.
        cost: the starting model (the conductor loads it lazily when None).
    Attributes: cost, refits and decode_refits (counts), errors and decode_errors
    (signed relative errors, > 0 over-predicts).
    """

    def __init__(self, settings: Settings, cost: CostModel | None = None):
        self.settings = settings
        self.cost = cost
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)   # relative TTFT errors
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=256)  # (new, cached, s) alone
        self._new_samples = 0
        self.decode_errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # relative step errors
        self.decode_samples: deque[tuple[int, int, float]] = deque(maxlen=512)  # (batch, ctx, s)
        self._new_decode_samples = 0
        self.decode_refits = 0
        self.refits = 0
        self._predicted: dict[str, tuple[float, float]] = {}      # rid -> (ttft_s, monotonic)
        self.prefill_step_errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        # calibration: observed/predicted ratios since the last one, steps seen, and the
        # product of the scales applied since the model was loaded or last refitted
        self._ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
        self.observed = {"prefill": 0, "decode": 0}
        self.scale = {"prefill": 1.0, "decode": 1.0}
        self.calibrations = 0
        # which steps brought each kind to conductor.admission_warmup (SERVED or
        # STARTUP_PROFILE; None before), and how many came from start-up profiles
        self.warmed_by: dict[str, str | None] = {"prefill": None, "decode": None}
        self.profile_steps = {"prefill": 0, "decode": 0}
        self._step_ratios: deque[float] = deque(maxlen=ERROR_WINDOW)   # measured / predicted
        # end-to-end TTFT: rid -> (predicted compute s, overhead s added, monotonic) until the
        # API node reports the observed TTFT; observed - predicted gaps; relative errors of
        # the prediction with and without the learned overhead (> 0 over-predicts)
        self._ttft_placed: dict[str, tuple[float, float, float]] = {}
        self.ttft_gaps: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.e2e_errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        # Request TBTs, in the units of the first decode model (a prediction divided by
        # _decode_gain, the product of every decode calibration's ratio), so that a
        # calibration while a request decodes cannot skew its ratio: rid -> (predicted
        # step, monotonic s) until its stream's TBT comes back, then (observed TBT /
        # that step, monotonic s) of the finished requests.
        self._tbt_placed: dict[str, tuple[float, float]] = {}
        self._decode_gain = 1.0
        self.tbt_ratios: deque[tuple[float, float]] = deque(maxlen=TBT_WINDOW)
        self.e2e_compute_errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        # /metrics: sums over every prediction that got its observation (cluster/node_metrics)
        self.ttft_pairs = 0
        self.predicted_ttft_sum_s = 0.0
        self.observed_ttft_sum_s = 0.0

    def predicted(self, rid: str, ttft_s: float, now: float) -> None:
        """Remembers the TTFT predicted for rid (seconds: the modelled compute and queues,
        without the overhead) until its prefill reports back, and until its API node
        reports the TTFT it observed (`observe_ttft`)."""
        self._predicted[rid] = (ttft_s, now)
        self._ttft_placed[rid] = (ttft_s, self.ttft_overhead_s(), now)
        for placed in (self._predicted, self._ttft_placed):
            if len(placed) > 10_000:               # placements that never reported back
                for old in [r for r, v in placed.items() if now - v[-1] > 600]:
                    del placed[old]

    def ttft_overhead_s(self) -> float:
        """The learned per-request TTFT overhead (seconds, `ttft_overhead_s` of the recent
        gaps) that admission adds to the predicted TTFT; 0 with
        conductor.refit_cost_model false (predictions stay what the loaded model says)."""
        if not self.settings.conductor.refit_cost_model:
            return 0.0
        return ttft_overhead_s(list(self.ttft_gaps))

    def observe_ttft(self, rid: str, observed_s: float) -> None:
        """Folds in the TTFT rid's API node observed (seconds, from the request's arrival
        to its first token): a gap sample for the overhead, and the end-to-end prediction
        errors with and without the overhead that was in use when rid was placed. A rid
        this conductor did not place (or placed decode-only) is ignored."""
        placed = self._ttft_placed.pop(rid, None)
        if placed is None or observed_s <= 0:
            return
        compute, overhead, _ = placed
        self.ttft_gaps.append(observed_s - compute)
        self.e2e_compute_errors.append((compute - observed_s) / observed_s)
        self.e2e_errors.append((compute + overhead - observed_s) / observed_s)

    def observe_prefill(self, d: PrefillDone) -> None:
        """Folds one finished prefill in: prediction error, and a refit sample if it ran alone."""
        pred = self._predicted.pop(d.rid, None)
        seconds = d.seconds
        if pred is not None and seconds > 0:
            self.errors.append((pred[0] - seconds) / seconds)
            self.ttft_pairs += 1
            self.predicted_ttft_sum_s += pred[0]
            self.observed_ttft_sum_s += seconds
        if d.alone and seconds > 0 and self.settings.conductor.refit_cost_model:
            self.samples.append((d.new, d.cached, seconds))
            self._new_samples += 1
            if self._new_samples >= REFIT_MIN_SAMPLES:
                self._new_samples = 0
                self._maybe_refit()

    def _maybe_refit(self) -> None:
        """Refits the prefill polynomial from recent solo prefills when the samples span
        enough lengths and the refit predicts them better than the current model."""
        if self.cost is None:
            return
        lengths = {s[0] for s in self.samples}
        if len(lengths) < 4 or max(lengths) < 4 * max(1, min(lengths)):
            return
        # no negative coefficient, as for decode: served prefills with long cached
        # prefixes are few and move with their length, and a fit learned a negative cost
        # a cached token (-0.25 ms), so a prefix hit of 400 tokens predicted 24 ms
        # against 150 ms served and longer hits 0 (a fresh user's trial, issue 33)
        new = _refit(self.cost.prefill, self.samples, ((0, 0), (1, 0), (0, 1), (1, 1)),
                     nonnegative=True)
        if new is not None:
            model, info = new
            self.cost = dataclasses.replace(self.cost, prefill=model,
                                            meta={**self.cost.meta, "refit": info})
            self.refits += 1
            self._refitted("prefill")
            log.info("cost_model_refit", part="prefill", **info)

    def calibrated(self, kind: str) -> bool:
        """Whether admission may enforce on the `kind` ("prefill" for TTFT, "decode" for
        TBT) predictions: the model is not the built-in default (a profile, an operator's
        file), or `conductor.admission_warmup` timed steps of that kind calibrated it."""
        if self.cost is not None and self.cost.meta.get("source") != "default":
            return True
        return self.observed[kind] >= self.settings.conductor.admission_warmup

    def predicted_tbt(self, rid: str, step_s: float, now: float) -> None:
        """Remembers the decode step predicted for rid with it in the batch (seconds),
        until its stream reports the TBT it saw (`observe_tbt`)."""
        if step_s > 0 and math.isfinite(step_s):
            self._tbt_placed[rid] = (step_s / self._decode_gain, now)
            if len(self._tbt_placed) > 10_000:       # requests that never reported back
                for old in [r for r, v in self._tbt_placed.items() if now - v[1] > 600]:
                    del self._tbt_placed[old]

    def observe_tbt(self, rid: str, tbt_s: float) -> None:
        """Folds in rid's TBT as its stream saw it (seconds, the paper's mean of the
        longest 10% of its gaps; measures.tbt_s): a sample of observed TBT / predicted
        step for `tbt_factor`, against that prediction as the model now makes it (scaled
        by the calibrations since: a burst that calibrated the model 3.5x up while its
        requests decoded otherwise left a factor of 6.8 that refused every request on an
        idle cluster). A rid without a prediction is ignored."""
        placed = self._tbt_placed.pop(rid, None)
        if placed is not None and tbt_s > 0:
            self.tbt_ratios.append((tbt_s / placed[0], time.monotonic()))

    def tbt_factor(self) -> float:
        """The paper's TBT (the mean of a request's longest 10% gaps) over the step time
        the model predicts. Once TBT_MIN_SAMPLES requests reported the TBT their streams
        saw within TBT_MAX_AGE_S (`observe_tbt`): the median of their observed TBT /
        predicted step, which holds what a request's longest gaps hold beyond its
        predicted step. Otherwise: the mean of the largest 10% of recent
        measured/predicted step ratios over their median (>= 1; 1 before TAIL_MIN_STEPS
        steps). 1 with conductor.refit_cost_model false. Admission compares predicted
        step x this with the TBT SLO. The age bound lets a check that refuses everything
        (so that no TBT comes back) fall back to the step tail within a minute."""
        if not self.settings.conductor.refit_cost_model:
            return 1.0
        recent = self._recent_tbt_ratios()
        if len(recent) >= TBT_MIN_SAMPLES:
            return statistics.median(recent) / self._decode_gain
        r = sorted(self._step_ratios)
        if len(r) < TAIL_MIN_STEPS:
            return 1.0
        top = r[-max(1, len(r) // 10):]
        return max(1.0, statistics.fmean(top) / statistics.median(r))

    def _recent_tbt_ratios(self) -> list[float]:
        """The observed TBT / predicted step ratios of the last TBT_MAX_AGE_S seconds."""
        now = time.monotonic()
        return [x for x, at in self.tbt_ratios if now - at <= TBT_MAX_AGE_S]

    def calibration_source(self, kind: str) -> str | None:
        """What `calibrated(kind)` rests on: the model's own source when it is not the
        built-in default ("profile" for `mooncaked profile`'s file, "calibrated" for the
        cached calibration of this machine, ...), else which steps reached
        conductor.admission_warmup (STARTUP_PROFILE or SERVED); None while uncalibrated."""
        if not self.calibrated(kind):
            return None
        if self.cost is not None and self.cost.meta.get("source") != "default":
            return str(self.cost.meta.get("source", ""))
        return self.warmed_by[kind] or SERVED

    def _calibrate(self, kind: str, predicted_s: float, seconds: float,
                   source: str = SERVED) -> None:
        """One timed step of `kind` (from `source`): after CALIBRATE_EVERY of them, scales
        that polynomial by their median observed/predicted ratio when it is off by more
        than the tolerance."""
        self.observed[kind] += 1
        if source == STARTUP_PROFILE:
            self.profile_steps[kind] += 1
        if (self.warmed_by[kind] is None
                and self.observed[kind] >= self.settings.conductor.admission_warmup):
            self.warmed_by[kind] = source
        if self.cost is None or predicted_s <= 0 or not self.settings.conductor.refit_cost_model:
            return
        ratios = self._ratios[kind]
        ratios.append(seconds / predicted_s)
        if len(ratios) < CALIBRATE_EVERY:
            return
        r = statistics.median(ratios)
        ratios.clear()
        if abs(r - 1.0) <= CALIBRATE_TOLERANCE:
            return
        self.scale[kind] *= r
        self.calibrations += 1
        if kind == "decode":
            self._step_ratios.clear()    # relative to the model this calibration replaced
            self._decode_gain *= r       # the TBT ratios' unit (see __init__)
        info = {"prefill_scale": round(self.scale["prefill"], 4),
                "decode_scale": round(self.scale["decode"], 4), "steps": dict(self.observed)}
        model = self.cost.prefill if kind == "prefill" else self.cost.decode
        self.cost = dataclasses.replace(self.cost, **{kind: scaled(model, r)},
                                        meta={**self.cost.meta, "calibration": info})
        log.info("cost_model_calibrated", part=kind, ratio=round(r, 4), **info)

    def _refitted(self, kind: str) -> None:
        """A refit replaced the `kind` polynomial: its calibration starts over from it (the
        scale is relative to the last fitted model)."""
        self.scale[kind] = 1.0
        self._ratios[kind].clear()
        if kind == "decode":
            # relative to the replaced polynomial. The TBT ratios are kept: a refit
            # replaces a model only by one that predicts the same steps better, and
            # clearing them on every refit (each few seconds when the load moves) left
            # the factor on its fallback most of the time (issue 33).
            self._step_ratios.clear()

    def observe_prefill_step(self, new_tokens: int, cached_tokens: int, seconds: float,
                             source: str = SERVED) -> None:
        """Folds one timed prefill step in (the new tokens of its chunks, the tokens cached
        before them, seconds; SERVED or STARTUP_PROFILE): prediction error, calibration,
        and a refit sample."""
        if seconds <= 0 or new_tokens < 1 or self.cost is None:
            return
        pred = self.cost.prefill_s(new_tokens, cached_tokens)
        if pred > 0 and source == SERVED:   # a profile step calibrates; it is not a prediction
            self.prefill_step_errors.append((pred - seconds) / seconds)
        self._calibrate("prefill", pred, seconds, source)
        if self.settings.conductor.refit_cost_model:
            self.samples.append((int(new_tokens), int(cached_tokens), float(seconds)))
            self._new_samples += 1
            if self._new_samples >= REFIT_MIN_SAMPLES:
                self._new_samples = 0
                self._maybe_refit()

    def observe_step(self, batch: int, context_tokens: int, seconds: float,
                     source: str = SERVED) -> None:
        """Folds one timed decode step in (batch size, context tokens, seconds; SERVED or
        STARTUP_PROFILE): prediction error, calibration, and a refit now and then."""
        if seconds <= 0 or batch < 1:
            return
        if self.cost is not None:
            pred = self.cost.decode_step_s(batch, context_tokens)
            # Errors and the TBT tail's ratios are of served steps only: a start-up profile's
            # steps calibrate the model, and those before its calibration are measured
            # against the uncalibrated default (x3-x8 off), which would read as a huge error
            # and, in the tail factor, inflate every TBT prediction until 200 steps passed.
            if source == SERVED:
                self.decode_errors.append((pred - seconds) / seconds)
                if pred > 0:
                    self._step_ratios.append(seconds / pred)
            self._calibrate("decode", pred, seconds, source)
        if not self.settings.conductor.refit_cost_model:
            return
        self.decode_samples.append((int(batch), int(context_tokens), float(seconds)))
        self._new_decode_samples += 1
        if self._new_decode_samples >= 4 * REFIT_MIN_SAMPLES:
            self._new_decode_samples = 0
            self._maybe_refit_decode()

    def _maybe_refit_decode(self) -> None:
        """Refits the decode-step model (batch size, context tokens) from served steps when
        they span enough batch sizes and contexts and the refit predicts them better."""
        if self.cost is None:
            return
        batches = {s[0] for s in self.decode_samples}
        contexts = [s[1] for s in self.decode_samples]
        if len(batches) < 3 or max(contexts) < 2 * max(1, min(contexts)):
            return
        new = _refit(self.cost.decode, self.decode_samples, DECODE_TERMS, nonnegative=True)
        if new is not None:
            self._use_decode(*new)

    def _use_decode(self, model: PolyModel, info: dict) -> None:
        """Replaces the decode polynomial by a refit `model` (`info`: its provenance)."""
        self.cost = dataclasses.replace(self.cost, decode=model,
                                        meta={**self.cost.meta, "decode_refit": info})
        self.decode_refits += 1
        self._refitted("decode")
        log.info("cost_model_refit", part="decode", **info)

    def fit_decode_profile(self, steps: Sequence[tuple[int, int, float]]) -> None:
        """The decode model's shape from a start-up profile's timed steps (batch size,
        context tokens, seconds; engine/startup_profile.py: batches of 1 to 8 short
        prompts), after they calibrated it: the fixed and per-sequence step costs are
        fitted with the context term held (the profile's context grows with its batch, so
        it cannot tell the two apart), and replace the model's when that predicts the
        profile's steps 20% better, with no negative coefficient. Calibration only scales
        a shape: the built-in default's fixed step is 10x its per-sequence cost, which on a
        CPU overstates batch 1 several-fold until served steps at three batch sizes refit
        it (issue 33: the first minutes after `mooncake up` must not reject on it). Only
        for a model of the default terms (DECODE_TERMS); a no-op without refits."""
        if self.cost is None or not self.settings.conductor.refit_cost_model:
            return
        current = self.cost.decode
        steps = [(int(b), int(c), float(t)) for b, c, t in steps if b >= 1 and t > 0]
        if tuple(current.terms) != DECODE_TERMS or len({b for b, _, _ in steps}) < 3:
            return
        per_context = current.coef[2]
        rest = [t - per_context * c for _, c, t in steps]
        if min(rest) <= 0:
            return
        try:
            fit = PolyModel.fit([b for b, _, _ in steps], [0.0] * len(steps), rest,
                                ((0, 0), (1, 0)))
        except ValueError:
            return
        new = PolyModel(DECODE_TERMS, (*fit.coef, per_context))
        info = _accepted(current, new, steps, nonnegative=True)
        if info is not None:
            self._use_decode(new, {**info, "source": STARTUP_PROFILE})

    def status(self) -> dict:
        """The model's name, source and refit counts, and both prediction-error summaries."""
        cost = self.cost
        observed_tbts = len(self._recent_tbt_ratios())
        return {"cost_model": None if cost is None else {
                    "name": cost.name, "source": cost.meta.get("source", ""),
                    "refits": self.refits, "decode_refits": self.decode_refits,
                    "calibrations": self.calibrations, "scale": dict(self.scale),
                    "tbt_factor": round(self.tbt_factor(), 4),
                    # what tbt_factor rests on: the TBTs streams saw, or the steps' tail
                    "tbt_factor_from": ("observed TBTs" if observed_tbts >= TBT_MIN_SAMPLES
                                        else "step tail"),
                    "observed_tbts": observed_tbts,
                    "observed_steps": dict(self.observed),
                    "calibrated": {k: self.calibrated(k) for k in ("prefill", "decode")},
                    "calibrated_by": {k: self.calibration_source(k)
                                      for k in ("prefill", "decode")},
                    "warmed_by": dict(self.warmed_by),
                    "profile_steps": dict(self.profile_steps),
                    # the polynomials in use now (after calibration and refits)
                    "prefill": cost.prefill.to_dict(), "decode": cost.decode.to_dict(),
                    "meta": cost.meta},
                "ttft_prediction": _error_summary(list(self.errors)),
                # what admission checks against the TTFT SLO: predicted + this overhead
                "ttft_overhead_s": round(self.ttft_overhead_s(), 4),
                # against the TTFT the API node observed: as admission predicts it (with
                # the overhead in use at placement), and the compute alone
                "ttft_e2e_prediction": _error_summary(list(self.e2e_errors)),
                "ttft_e2e_prediction_compute_only": _error_summary(
                    list(self.e2e_compute_errors)),
                "prefill_step_prediction": _error_summary(list(self.prefill_step_errors)),
                "decode_step_prediction": _error_summary(list(self.decode_errors))}


def _error_summary(errs: list[float]) -> dict:
    """Signed relative prediction errors -> {"samples", "median_rel_error",
    "median_abs_rel_error"} (> 0 over-predicts)."""
    return {"samples": len(errs),
            "median_rel_error": statistics.median(errs) if errs else None,
            "median_abs_rel_error": statistics.median(abs(e) for e in errs) if errs else None}


__all__ = ["CALIBRATE_EVERY", "CALIBRATE_TOLERANCE", "CostModelRefitter", "REFIT_MIN_SAMPLES",
           "OVERHEAD_MIN_SAMPLES", "SERVED", "STARTUP_PROFILE", "TAIL_MIN_STEPS", "TBT_MAX_AGE_S",
           "scaled", "ttft_overhead_s"]
