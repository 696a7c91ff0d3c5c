"""Cost models the conductor predicts with: prefill time, decode step time, transfer time.

Pure functions and plain data (no I/O besides the explicit `save`/`load` helpers,
no clock): the live conductor and the simulator call the same code.

- Prefill time is a polynomial in (new tokens, cached tokens), fitted by least
  squares on measured samples (Mooncake paper, section 4: "polynomial regression
  on prompt length and prefix hit length").
- Decode step time is a polynomial in (batch size, total context tokens of the
  batch): weights are read once per step, every cached token's KV once per step.
- Transfer time is a fixed latency plus bytes / bandwidth, with
  bytes = tokens * kv_bytes_per_token.

`paper_cost_model()` builds the paper's setting (LLaMA3-70B on an 8xA800 node,
Table 1 and Equation 1); `mooncaked profile` fits the same shapes on this
hardware and saves them with `CostModel.save`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1

# (i, j) exponents of x1^i * x2^j. Prefill: x1 = new tokens, x2 = cached tokens. Equation 1
# gives flops(n) - flops(p) = l*(a*(x^2 + 2*x*c)*d + b*x*d^2) with x = n - p, c = p, so the
# terms x, x^2 and x*c carry the physics; c alone is the cost of loading the cached prefix.
PREFILL_TERMS: tuple[tuple[int, int], ...] = ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1))
# Decode: x1 = batch size, x2 = total context tokens in the batch (a memory-bound step).
DECODE_TERMS: tuple[tuple[int, int], ...] = ((0, 0), (1, 0), (0, 1))


@dataclass(frozen=True)
class PolyModel:
    """y = sum_k coef[k] * x1**terms[k][0] * x2**terms[k][1].

    Attributes:
        terms: exponent pairs (i, j), non-negative ints.
        coef: one float per term (units of y divided by the term's units).
    Raises (constructor): ValueError when terms and coef differ in length or an exponent
        is negative.
    """

    terms: tuple[tuple[int, int], ...]
    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        terms = tuple((int(i), int(j)) for i, j in self.terms)
        coef = tuple(float(c) for c in self.coef)
        if len(terms) != len(coef) or not terms:
            raise ValueError(f"PolyModel needs one coefficient per term, got {len(terms)} terms "
                             f"and {len(coef)} coefficients")
        if any(i < 0 or j < 0 for i, j in terms):
            raise ValueError(f"PolyModel exponents must be >= 0: {terms}")
        if not all(math.isfinite(c) for c in coef):
            raise ValueError(f"PolyModel coefficients must be finite: {coef}")
        object.__setattr__(self, "terms", terms)
        object.__setattr__(self, "coef", coef)
        # The placement function evaluates these models per node on every request, so the
        # polynomial is compiled once into a plain lambda (as namedtuple once built its
        # classes): the source holds only float reprs and int exponents we just validated.
        mono = [" * ".join(["x1"] * i + ["x2"] * j) or "1.0" for i, j in terms]
        body = " + ".join(f"{c!r} * {m}" for c, m in zip(coef, mono))
        object.__setattr__(self, "_fn", eval(f"lambda x1, x2: {body}", {}))  # noqa: S307

    def __call__(self, x1: float, x2: float) -> float:
        """Evaluates the polynomial at one point (plain floats, no numpy: a hot path)."""
        return self._fn(x1, x2)

    def grid(self, x1: float, x2: np.ndarray) -> np.ndarray:
        """Evaluates at a fixed x1 for every x2 in a float64 array of shape [k]; returns [k]."""
        x2 = np.asarray(x2, dtype=np.float64)
        y = np.zeros_like(x2)
        for (i, j), c in zip(self.terms, self.coef):
            y += c * (x1 ** i) * (x2 ** j if j else 1.0)
        return y

    @classmethod
    def fit(cls, x1: Sequence[float], x2: Sequence[float], y: Sequence[float],
            terms: Sequence[tuple[int, int]], relative: bool = True) -> PolyModel:
        """Least-squares fit of the coefficients of `terms` to samples (numpy.linalg.lstsq).

        With `relative` (the default) each sample is weighted by 1/|y|, so the fit minimizes
        relative error: timings span orders of magnitude (a 100-token prefill and a
        100k-token one) and a 10 ms miss matters only on the short one. Columns are scaled
        to unit max before solving so that terms of very different magnitude (1 and n^2
        with n ~ 1e5) stay well conditioned.
        Raises: ValueError with fewer samples than terms, mismatched lengths, or non-finite
            values.
        """
        a1, a2, ay = (np.asarray(v, dtype=np.float64) for v in (x1, x2, y))
        if not (a1.shape == a2.shape == ay.shape) or a1.ndim != 1:
            raise ValueError("fit needs three 1-D sequences of equal length")
        if len(ay) < len(terms):
            raise ValueError(f"fit needs at least {len(terms)} samples for {len(terms)} terms, "
                             f"got {len(ay)}")
        if not (np.isfinite(a1).all() and np.isfinite(a2).all() and np.isfinite(ay).all()):
            raise ValueError("fit samples must be finite")
        cols = np.stack([a1 ** i * a2 ** j for i, j in terms], axis=1)
        if relative:
            w = 1.0 / np.maximum(np.abs(ay), 1e-12)
            cols, ay = cols * w[:, None], ay * w
        scale = np.abs(cols).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(cols / scale, ay, rcond=None)
        return cls(tuple(terms), tuple((sol / scale).tolist()))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: {"terms": [[i, j], ...], "coef": [...]}."""
        return {"terms": [list(t) for t in self.terms], "coef": list(self.coef)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolyModel:
        """Inverse of `to_dict`. Raises: ValueError on a malformed object."""
        try:
            return cls(tuple(tuple(t) for t in d["terms"]), tuple(d["coef"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed polynomial model {d!r}: {e}") from e


@dataclass(frozen=True)
class TransferModel:
    """Transfer time of KV blocks between nodes: latency_s + bytes / bandwidth_bytes_per_s."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(f"transfer model needs bandwidth > 0 and latency >= 0: {self}")

    def seconds(self, nbytes: float) -> float:
        """Seconds to move `nbytes` bytes (0 bytes cost nothing)."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    """Everything the conductor predicts with, for one model on one kind of node.

    Attributes:
        prefill: seconds as a PolyModel of (new tokens, cached tokens).
        decode: seconds per decode step as a PolyModel of (batch size, context tokens).
        transfer: KV transfer between nodes.
        kv_bytes_per_token: bytes of K and V over all layers for one token.
        name: free text (model, hardware).
        meta: free-form provenance (fit error, sample counts, date); kept on save/load.
    """

    prefill: PolyModel
    decode: PolyModel
    transfer: TransferModel
    kv_bytes_per_token: int
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def prefill_s(self, new_tokens: float, cached_tokens: float) -> float:
        """Predicted prefill time, seconds, of `new_tokens` after a cached prefix (never < 0)."""
        return max(0.0, self.prefill(new_tokens, cached_tokens))

    def decode_step_s(self, batch_size: float, context_tokens: float) -> float:
        """Predicted time of one decode step of `batch_size` requests holding `context_tokens`."""
        return max(0.0, self.decode(batch_size, context_tokens))

    def transfer_s(self, tokens: float) -> float:
        """Predicted time to move the KV of `tokens` tokens between nodes, seconds."""
        return self.transfer.seconds(tokens * self.kv_bytes_per_token)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (see `from_dict`)."""
        return {"format": "mooncaked-cost-model", "version": FORMAT_VERSION, "name": self.name,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "transfer": {"bandwidth_bytes_per_s": self.transfer.bandwidth_bytes_per_s,
                             "latency_s": self.transfer.latency_s},
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """Builds a model from `to_dict` output. Raises: ValueError naming what is wrong."""
        if not isinstance(d, dict) or d.get("format") != "mooncaked-cost-model":
            raise ValueError("not a mooncaked cost model (missing format: mooncaked-cost-model)")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost model version {d.get('version')!r} is not supported "
                             f"(expected {FORMAT_VERSION})")
        try:
            t = d["transfer"]
            kvb = int(d["kv_bytes_per_token"])
            if kvb <= 0:
                raise ValueError(f"kv_bytes_per_token must be > 0, got {kvb}")
            return cls(prefill=PolyModel.from_dict(d["prefill"]),
                       decode=PolyModel.from_dict(d["decode"]),
                       transfer=TransferModel(float(t["bandwidth_bytes_per_s"]),
                                              float(t.get("latency_s", 0.0))),
                       kv_bytes_per_token=kvb, name=str(d.get("name", "")),
                       meta=dict(d.get("meta", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed cost model: missing or wrong field {e}") from e

    def save(self, path: str | Path) -> None:
        """Writes the model as JSON (atomically: a temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Reads a model saved by `save`. Raises: ValueError naming the file on bad content,
        OSError when it cannot be read."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from e
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def with_measured_bandwidth(model: CostModel, rates: Sequence[float]) -> CostModel:
    """`model` with its transfer bandwidth replaced by the median of the measured path
    rates (bytes/s, as the nodes' transfer engines report them: transfer/bandwidth.py);
    its latency stays. `model` itself when nothing was measured. The conductor predicts
    fetch-or-recompute with it, so a slow network recomputes what a fast one fetches."""
    rates = [r for r in rates if r > 0]
    if not rates:
        return model
    return dataclasses.replace(model, transfer=dataclasses.replace(
        model.transfer, bandwidth_bytes_per_s=statistics.median(rates)))


@dataclass(frozen=True)
class PaperSetting:
    """The paper's Table 1 (LLaMA3-70B on one 8xA800 node) plus the efficiencies we assume.

    Table 1 values: l, d, a, b, gqa, s, G (8 x 312 TFLOPS), B_h2d 128 GB/s, B_nic 800 Gbps.
    Our assumptions (not in the paper): model FLOP utilization of prefill and decode,
    HBM bandwidth of an A800 (2.039 TB/s) and the share of it a decode step reaches,
    70.6e9 parameters, and a per-step overhead (tensor-parallel collectives, sampling).
    """

    layers: int = 80                      # l
    d_model: int = 8192                   # d
    a: float = 4.0
    b: float = 22.0
    gqa: int = 8
    bytes_per_elem: int = 2               # s (bf16)
    gpu_flops: float = 8 * 312e12         # G, FLOP/s
    h2d_bytes_per_s: float = 128e9        # B_h2d
    nic_bytes_per_s: float = 800e9 / 8    # B_nic, 800 Gbps
    prefill_mfu: float = 0.5
    params: float = 70.6e9
    hbm_bytes_per_s: float = 8 * 2.039e12
    hbm_efficiency: float = 0.7
    decode_mfu: float = 0.5
    decode_overhead_s: float = 0.003
    gpu_memory_bytes: float = 8 * 80e9
    kv_memory_share: float = 0.9          # share of (GPU memory - weights) usable for KV

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) * layers * d / gqa * bytes: 320 KiB for LLaMA3-70B (paper section 2.2)."""
        return int(2 * self.layers * self.d_model // self.gqa * self.bytes_per_elem)

    @property
    def decode_kv_capacity_tokens(self) -> int:
        """Tokens of KV one 8xA800 decode instance holds next to the bf16 weights."""
        free = (self.gpu_memory_bytes - 2 * self.params) * self.kv_memory_share
        return int(free // self.kv_bytes_per_token)


def paper_cost_model(setting: PaperSetting | None = None) -> CostModel:
    """The paper's setting as a CostModel (section 2.2, Table 1, Equation 1).

    Prefill: Equation 1's FLOPs of the uncached part, flops(n) - flops(p)
    = l*(a*(x^2 + 2*x*c)*d + b*x*d^2) for x new and c cached tokens, divided by
    G * prefill_mfu. Decode step: read the bf16 weights and every context token's
    KV from HBM at hbm_efficiency, plus 2*params FLOPs per sequence at decode_mfu,
    plus a fixed overhead. Transfer: KV bytes over min(B_h2d, B_nic).
    """
    s = setting or PaperSetting()
    g = s.gpu_flops * s.prefill_mfu
    layers, d = s.layers, s.d_model
    prefill = PolyModel(PREFILL_TERMS, (0.0, layers * s.b * d * d / g, 0.0, layers * s.a * d / g,
                                        2 * layers * s.a * d / g))
    hbm = s.hbm_bytes_per_s * s.hbm_efficiency
    decode = PolyModel(DECODE_TERMS, (s.decode_overhead_s + 2 * s.params / hbm,
                                      2 * s.params / (s.gpu_flops * s.decode_mfu),
                                      s.kv_bytes_per_token / hbm))
    return CostModel(prefill=prefill, decode=decode,
                     transfer=TransferModel(min(s.h2d_bytes_per_s, s.nic_bytes_per_s)),
                     kv_bytes_per_token=s.kv_bytes_per_token,
                     name="LLaMA3-70B on 8xA800 (Mooncake paper, Table 1 + Equation 1)",
                     meta={"source": "paper", "prefill_mfu": s.prefill_mfu,
                           "decode_kv_capacity_tokens": s.decode_kv_capacity_tokens})


def fit_cost_model(prefill_samples: Sequence[tuple[float, float, float]],
                   decode_samples: Sequence[tuple[float, float, float]],
                   bandwidth_bytes_per_s: float, kv_bytes_per_token: int, *,
                   latency_s: float = 0.0, name: str = "",
                   prefill_terms: Sequence[tuple[int, int]] = PREFILL_TERMS,
                   decode_terms: Sequence[tuple[int, int]] = DECODE_TERMS) -> CostModel:
    """Fits a CostModel from measurements (what `mooncaked profile` calls).

    Args:
        prefill_samples: (new tokens, cached tokens, seconds) triples.
        decode_samples: (batch size, context tokens, seconds per step) triples.
        bandwidth_bytes_per_s, latency_s: measured transfer figures.
        kv_bytes_per_token: of the served model.
    Returns: the model, with each fit's RMS and max relative error in `meta`.
    Raises: ValueError on too few or non-finite samples.
    """
    def _fit(samples, terms):
        x1, x2, y = zip(*samples) if samples else ((), (), ())
        m = PolyModel.fit(x1, x2, y, terms)
        pred = np.array([m(a, b) for a, b in zip(x1, x2)])
        ya = np.asarray(y, dtype=np.float64)
        rel = np.abs(pred - ya) / np.maximum(np.abs(ya), 1e-12)
        return m, {"samples": len(ya), "rms_s": float(np.sqrt(np.mean((pred - ya) ** 2))),
                   "max_rel_error": float(rel.max())}

    pm, pstats = _fit(list(prefill_samples), prefill_terms)
    dm, dstats = _fit(list(decode_samples), decode_terms)
    return CostModel(prefill=pm, decode=dm, transfer=TransferModel(bandwidth_bytes_per_s, latency_s),
                     kv_bytes_per_token=kv_bytes_per_token, name=name,
                     meta={"source": "fit", "prefill_fit": pstats, "decode_fit": dstats})


def step_with_request_s(cost: CostModel, batch: int, context_tokens: float,
                        prompt_tokens: float) -> float:
    """Predicted decode step time (seconds) of a node running `batch` requests holding
    `context_tokens` KV tokens once it admits one more with `prompt_tokens` tokens: the
    request's predicted TBT. The conductor (coupled placement) and the decode node's own
    TBT check (cluster/admission.py) predict with this same function."""
    return cost.decode_step_s(batch + 1, context_tokens + prompt_tokens)
