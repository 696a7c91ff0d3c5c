"""Prefill timing of a chunked-pipeline-parallel (CPP) group (Mooncake section 3.3).

A group of `stages` prefill nodes holds contiguous, equal slices of the layers. A
prompt's uncached part is cut into chunks of `chunk_tokens`; chunk i runs on stage k
while chunk i+1 runs on stage k-1. With the single-node prefill model P(x new, c cached)
(conductor/cost_model.py), chunk i (x_i new tokens after c_i cached or earlier ones)
takes s_i = P(x_i, c_i) / stages on each stage, and its hidden states
([x_i, hidden] in the activation dtype) cross each of the stages - 1 boundaries:

    latency   = sum_i s_i + (stages - 1) * (max_i s_i + hop(x_max))    fill + drain bubble
    occupancy = sum_i s_i                                              stage 0's busy time

`latency` is the prefill part of a request's TTFT; `occupancy` is how long the group's
first stage is busy, i.e. when the next request may enter (throughput). Pure functions,
no clock: the conductor and the simulator share them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cost_model import CostModel


@dataclass(frozen=True)
class PipelineTiming:
    """One request's predicted prefill on a CPP group, seconds."""

    latency_s: float
    occupancy_s: float
    chunks: int


def pipeline_timing(cost: CostModel, new_tokens: float, cached_tokens: float, stages: int,
                    chunk_tokens: int, hidden_bytes_per_token: int) -> PipelineTiming:
    """Latency and first-stage occupancy of prefilling `new_tokens` after `cached_tokens`
    on a group of `stages` equal stages (see the module doc).

    Raises: ValueError for stages < 1 or chunk_tokens < 1.
    """
    if stages < 1 or chunk_tokens < 1:
        raise ValueError("stages and chunk_tokens must be >= 1")
    if new_tokens <= 0:
        return PipelineTiming(0.0, 0.0, 0)
    total, worst, done, chunks = 0.0, 0.0, 0.0, 0
    while done < new_tokens:
        x = min(chunk_tokens, new_tokens - done)
        s = cost.prefill_s(x, cached_tokens + done) / stages
        total += s
        worst = max(worst, s)
        done += x
        chunks += 1
    hop = cost.transfer.seconds(min(chunk_tokens, new_tokens) * hidden_bytes_per_token) if stages > 1 else 0.0
    return PipelineTiming(total + (stages - 1) * (worst + hop), total, chunks)


@dataclass(frozen=True)
class PipelinedCostModel(CostModel):
    """A CostModel whose prefill_s is a CPP group's pipelined latency, so Algorithm 1's TTFT
    estimate (conductor/policy.py) uses it unchanged; decode and transfer are the base's.

    Build with `PipelinedCostModel.of(base, stages, chunk_tokens, hidden_bytes_per_token)`.
    """

    stages: int = 1
    chunk_tokens: int = 4096
    hidden_bytes_per_token: int = 16384

    @classmethod
    def of(cls, base: CostModel, stages: int, chunk_tokens: int, hidden_bytes_per_token: int
           ) -> PipelinedCostModel:
        """Wraps `base` (copied field by field). Raises ValueError for stages/chunk < 1."""
        if stages < 1 or chunk_tokens < 1 or hidden_bytes_per_token < 0:
            raise ValueError("stages and chunk_tokens must be >= 1, hidden bytes >= 0")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)}
        return cls(**fields, stages=stages, chunk_tokens=chunk_tokens,
                   hidden_bytes_per_token=hidden_bytes_per_token)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_base", CostModel(self.prefill, self.decode, self.transfer, self.kv_bytes_per_token,
                                                    self.name, self.meta))

    def timing(self, new_tokens: float, cached_tokens: float) -> PipelineTiming:
        """pipeline_timing with this model's group."""
        return pipeline_timing(self._base, new_tokens, cached_tokens, self.stages, self.chunk_tokens,
                               self.hidden_bytes_per_token)

    def prefill_s(self, new_tokens: float, cached_tokens: float) -> float:
        """The group's pipelined prefill latency, seconds."""
        return self.timing(new_tokens, cached_tokens).latency_s
