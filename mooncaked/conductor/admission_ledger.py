"""Admission decisions (Mooncake section 4 step 4 and section 7, early rejection) under an
operator's mode, and the record of what was decided.

A check (the conductor's TTFT/TBT prediction, a decode node's TBT check) first predicts
whether the request would miss an SLO. `decide` turns that prediction into what happens:

- mode ``enforce``: reject, unless the cost model the prediction came from is not
  calibrated yet (the built-in default with fewer than `conductor.admission_warmup`
  served steps behind it): then ``shadow``, as a new machine must not reject on a model
  from another CPU; or unless the request is in the holdout (`in_holdout`: a share
  `conductor.admission_holdout` of the requests, by a hash of the request id, so every
  check agrees): then ``shadow`` too, so whether it meets the SLOs tells whether the
  rejection would have been false, near the load an enforcing cluster runs at (shadow
  mode admits every predicted miss and so runs busier);
- mode ``shadow``: ``shadow`` (counted, logged, admitted);
- mode ``off``: ``admit``.

`AdmissionLedger` keeps the counts and, per request id, the predictions and the verdict
(bounded: the newest `LEDGER_SIZE`), so a benchmark or an operator can set them against
what happened (false rejections: shadow rejections that met both SLOs; misses: admitted
requests that did not). Pure data, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MODES = ("enforce", "shadow", "off")
ADMIT, REJECT, SHADOW = "admit", "reject", "shadow"
LEDGER_SIZE = 4096


def decide(mode: str, miss_reason: str | None, calibrated: bool, holdout: bool = False) -> str:
    """What happens to a request a check predicted would miss for `miss_reason` (None: it
    would not): ADMIT, REJECT or SHADOW (admitted, but counted as a rejection the
    enforcing check would have made). `holdout`: the request is in the holdout
    (`in_holdout`; enforce admits it as SHADOW). See the module doc.

    Raises: ValueError on an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"unknown admission mode {mode!r}; choose one of {', '.join(MODES)}")
    if miss_reason is None or mode == "off":
        return ADMIT
    if mode == "enforce" and calibrated and not holdout:
        return REJECT
    return SHADOW


def in_holdout(share: float, rid: str) -> bool:
    """Whether request `rid` is in the holdout of an enforcing check: a hash of rid
    (BLAKE2b, 64 bits) read as a number in [0, 1) is below `share`
    (`conductor.admission_holdout`, 0..1). The same rid gives the same answer at the
    conductor and at the decode node, so a request held out by one is not refused by the
    other: each would-be rejection runs with probability `share`, whichever checks
    predicted its miss (what the benchmark's estimate of false rejections assumes)."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(rid.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < share


@dataclass(frozen=True)
class Decision:
    """One request's admission: its verdict (ADMIT, REJECT, SHADOW), the reason a miss was
    predicted ("" when none), the predictions (seconds, NaN when not predicted), whether
    the cost model was calibrated and whether an enforcing check admitted the predicted
    miss because the request is in its holdout."""

    verdict: str
    reason: str
    predicted_ttft_s: float
    predicted_tbt_s: float
    calibrated: bool
    held_out: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (NaN predictions as None)."""
        def f(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 5)
        return {"verdict": self.verdict, "reason": self.reason,
                "predicted_ttft_s": f(self.predicted_ttft_s),
                "predicted_tbt_s": f(self.predicted_tbt_s), "calibrated": self.calibrated,
                "held_out": self.held_out}


class AdmissionLedger:
    """Counts of verdicts and the newest LEDGER_SIZE decisions by request id.

    Attributes: counts {"admit", "reject", "shadow"} -> int; by_reason {verdict: {reason:
    int}} for reject and shadow; held_out (the shadow verdicts of the holdout)."""

    def __init__(self, size: int = LEDGER_SIZE):
        self.size = size
        self.counts = {ADMIT: 0, REJECT: 0, SHADOW: 0}
        self.held_out = 0
        self.by_reason: dict[str, dict[str, int]] = {REJECT: {}, SHADOW: {}}
        self._entries: OrderedDict[str, Decision] = OrderedDict()

    def record(self, rid: str, d: Decision) -> None:
        """Counts d and keeps it under rid (a re-placement of rid replaces the entry)."""
        self.counts[d.verdict] += 1
        self.held_out += d.held_out
        if d.verdict != ADMIT:
            r = self.by_reason[d.verdict]
            r[d.reason] = r.get(d.reason, 0) + 1
        self._entries[rid] = d
        self._entries.move_to_end(rid)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def entries(self, rids: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """rid -> Decision.to_json() for `rids` (those it still holds), or all it holds."""
        keys = self._entries.keys() if rids is None else [r for r in rids if r in self._entries]
        return {r: self._entries[r].to_json() for r in keys}

    def status(self) -> dict[str, Any]:
        """The counts, for `ctl status` and /metrics."""
        return {"admitted": self.counts[ADMIT], "rejected": self.counts[REJECT],
                "shadow_rejected": self.counts[SHADOW], "held_out": self.held_out,
                "rejected_by_reason": dict(self.by_reason[REJECT]),
                "shadow_rejected_by_reason": dict(self.by_reason[SHADOW])}


__all__ = ["ADMIT", "AdmissionLedger", "Decision", "LEDGER_SIZE", "MODES", "REJECT", "SHADOW",
           "decide", "in_holdout"]
