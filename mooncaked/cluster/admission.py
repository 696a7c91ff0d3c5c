"""Node-side TBT admission (Mooncake section 6 / Algorithm 1 step 4, at the decode node).

The conductor rejects a request whose predicted TBT breaks `conductor.tbt_slo_s`, but
it predicts from reports up to `cluster.report_interval_s` old. The decode node checks
again, with its live batch, when the prefill node asks it to admit the request before
computing (decode_worker.py `admit`: DecodeRefused, a 429 for the client, no prefill
spent), or when a request it did not admit arrives; a coupled node when the request
arrives. It refuses (HTTP 429 with Retry-After, the reason in the body) when its
predicted step time with the request exceeds the TBT SLO.

Both sides predict the same way: `step_with_request_s(cost, batch, context, prompt)` =
`cost.decode_step_s(batch + 1, context + prompt)` over the same cost model (the file
`mooncaked profile` wrote, or the default), refitted by the same `CostModelRefitter`
from the same timed decode steps (the node feeds it the steps it reports to the
conductor). With one decode node the two models are identical; with several, the
conductor's refit also sees the other nodes' steps.

`conductor.node_admission` (enforce | shadow | off) sets what a predicted miss does
(conductor/admission_ledger.py `decide`): with enforce, the built-in default model
decides as shadow until `conductor.admission_warmup` timed steps calibrated it, and
the requests in the holdout (`conductor.admission_holdout`, the same requests as at
the conductor) are admitted as shadow too. Every decision is kept in an AdmissionLedger
by request id (`admission.ledger` RPC).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from mooncaked.conductor.admission_ledger import (ADMIT, REJECT, AdmissionLedger, Decision,
                                                  decide, in_holdout)
from mooncaked.conductor.cost_model import CostModel, step_with_request_s
from mooncaked.conductor.cost_store import load_cost_model
from mooncaked.conductor.refit import SERVED, STARTUP_PROFILE, CostModelRefitter
from mooncaked.config import Settings
from mooncaked.measures import tbt_s


START_DELAY_MIN_SAMPLES = 8    # admissions that reached the node before their start is predicted
START_DELAY_WINDOW = 64        # recent admissions the prediction takes its median over


def still_decoding(running: Iterable[tuple[int, int | None]], step_s: float,
                   starts_in_s: float) -> tuple[int, int]:
    """(requests, KV tokens) of the running requests still decoding `starts_in_s` seconds
    from now, when a request admitted now starts to (after its prefill): those whose
    output tokens left x `step_s` (the step time now, seconds) reach past it.

    Args:
        running: (KV tokens, output tokens left or None: unknown, counted) per request.
    Counting every running request predicted a request's steps at the batch of the
    moment it was admitted, though with outputs of tens of tokens most of it finishes
    before the request's prefill does (issue 33: predicted steps 1.5-2x the gaps seen).
    """
    batch = context = 0
    for tokens, left in running:
        if left is None or left * step_s >= starts_in_s:
            batch += 1
            context += tokens
    return batch, context


class DecodeAdmission:
    """The TBT check of one decode (or coupled) node (see the module doc).

    Args:
        settings: conductor.tbt_slo_s, min_retry_after_s, cost_model, refit_cost_model,
            node_admission, admission_warmup.
        kv_bytes_per_token: of this node's engine (for the default cost model).
    Attributes: refused (requests refused), ledger (every decision by request id).
    """

    def __init__(self, settings: Settings, kv_bytes_per_token: int):
        self.slo_s = settings.conductor.tbt_slo_s
        self.retry_after_s = settings.conductor.min_retry_after_s
        self._settings, self._kvb = settings, kv_bytes_per_token
        self.model = CostModelRefitter(settings, None)
        self.mode = settings.conductor.node_admission
        self.holdout_share = settings.conductor.admission_holdout
        self.refused = 0
        self.ledger = AdmissionLedger()
        # seconds per prompt token from admission to arrival (the prefill and hand-over)
        self._start_delays: deque[float] = deque(maxlen=START_DELAY_WINDOW)

    def _cost(self) -> CostModel:
        if self.model.cost is None:
            self.model.cost = load_cost_model(self._settings, self._kvb)
        return self.model.cost

    def observe(self, steps: Iterable[tuple[int, int, float]], source: str = SERVED) -> None:
        """Folds in timed decode steps (batch size, context tokens, seconds) from `source`
        (refit.SERVED, or refit.STARTUP_PROFILE: this node's start-up profile)."""
        if not math.isfinite(self.slo_s):
            return
        self._cost()
        steps = list(steps)
        for b, c, s in steps:
            self.model.observe_step(b, c, s, source)
        if source == STARTUP_PROFILE:
            self.model.fit_decode_profile(steps)

    def observe_start(self, prompt_tokens: int, seconds: float) -> None:
        """Folds in one admitted request's arrival: `seconds` from its admission (before its
        prefill) to its /internal/decode, for `prompt_tokens` prompt tokens."""
        if prompt_tokens > 0 and seconds >= 0:
            self._start_delays.append(seconds / prompt_tokens)

    def starts_in_s(self, prompt_tokens: int) -> float:
        """When a request admitted now is predicted to start decoding here, seconds from
        now: its prompt tokens x the median seconds per token of the recent admissions'
        prefill and hand-over (`observe_start`); 0 before START_DELAY_MIN_SAMPLES."""
        if len(self._start_delays) < START_DELAY_MIN_SAMPLES:
            return 0.0
        return prompt_tokens * statistics.median(self._start_delays)

    def step_s(self, batch: int, context_tokens: int) -> float:
        """The model's decode step time (seconds) at `batch` requests holding
        `context_tokens` KV tokens (0 for an empty batch)."""
        return self._cost().decode_step_s(batch, context_tokens) if batch else 0.0

    def check(self, batch: int, context_tokens: int, prompt_tokens: int, rid: str = ""
              ) -> dict[str, Any] | None:
        """None when the request may be admitted (also a shadow rejection, recorded under
        `rid`); else the refusal: {"error", "reason": "tbt_slo", "predicted_tbt_s",
        "tbt_slo_s", "retry_after_s"}."""
        if not math.isfinite(self.slo_s) or self.mode == "off":
            return None
        tbt = step_with_request_s(self._cost(), batch, context_tokens, prompt_tokens)
        calibrated = self.model.calibrated("decode")
        factor = self.model.tbt_factor()
        over = tbt * factor > self.slo_s     # its longest gaps, not the step
        drawn = (over and self.mode == "enforce" and calibrated
                 and in_holdout(self.holdout_share, rid))
        verdict = decide(self.mode, "tbt_slo" if over else None, calibrated, drawn)
        if rid:
            self.ledger.record(rid, Decision(verdict, "" if verdict == ADMIT else "tbt_slo",
                                             math.nan, tbt, calibrated, drawn))
        if verdict != REJECT:
            if rid:
                self.model.predicted_tbt(rid, tbt, time.monotonic())
            return None
        self.refused += 1
        return {"error": f"decode node at its TBT budget: predicted TBT {tbt * factor:.3f} s "
                         f"(step {tbt:.3f} s x TBT factor {factor:.2f}) with this request "
                         f"({batch + 1} requests, {context_tokens + prompt_tokens} context "
                         f"tokens) exceeds the TBT SLO {self.slo_s:.3f} s",
                "reason": "tbt_slo", "predicted_tbt_s": tbt * factor, "tbt_slo_s": self.slo_s,
                "retry_after_s": self.retry_after_s}

    def observe_tbt(self, rid: str, token_times_s: list[float]) -> None:
        """rid finished: its TBT as this node's stream sent it (measures.tbt_s of the
        send times of its tokens, seconds, the first token's included) teaches the TBT
        factor (CostModelRefitter.observe_tbt). Fewer than two tokens: nothing."""
        if len(token_times_s) >= 2 and math.isfinite(self.slo_s):
            self.model.observe_tbt(rid, tbt_s(token_times_s))

    def ledger_view(self, rids: list[str] | None = None) -> dict[str, Any]:
        """The mode, counts and decisions (for `rids`, or all it holds) of this check."""
        return {**self.status(), "decisions": self.ledger.entries(rids)}

    def status(self) -> dict[str, Any]:
        """node.status "admission": mode, counts, and the model's step-prediction error."""
        m = self.model.status()
        return {"mode": self.mode, "holdout_share": self.holdout_share,
                **self.ledger.status(),
                # whether it checks anything: a TBT SLO set and the mode not off
                "active": math.isfinite(self.slo_s) and self.mode != "off",
                "calibrated": self.model.calibrated("decode"),
                "calibrated_by": self.model.calibration_source("decode"),
                "decode_step_prediction": m["decode_step_prediction"],
                "tbt_factor": None if m["cost_model"] is None else {
                    k: m["cost_model"][k] for k in ("tbt_factor", "tbt_factor_from",
                                                    "observed_tbts")},
                "cost_model": None if m["cost_model"] is None else {
                    k: m["cost_model"][k] for k in ("name", "source", "scale", "observed_steps",
                                                    "profile_steps", "decode_refits")}}


__all__ = ["DecodeAdmission", "START_DELAY_MIN_SAMPLES", "START_DELAY_WINDOW", "still_decoding"]
