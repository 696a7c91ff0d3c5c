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
    scale: float = 1.0      # measured / predicted pipelined time of this group (GroupLearner)

    @classmethod
    def of(cls, base: CostModel, stages: int, chunk_tokens: int, hidden_bytes_per_token: int,
           scale: float = 1.0) -> PipelinedCostModel:
        """Wraps `base` (copied field by field); `scale` multiplies the pipelined times.
        Raises ValueError for stages/chunk < 1 or scale <= 0."""
        if stages < 1 or chunk_tokens < 1 or hidden_bytes_per_token < 0 or not scale > 0:
            raise ValueError("stages and chunk_tokens must be >= 1, hidden bytes >= 0, scale > 0")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)}
        return cls(**fields, stages=stages, chunk_tokens=chunk_tokens,
                   hidden_bytes_per_token=hidden_bytes_per_token, scale=scale)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_base", CostModel(self.prefill, self.decode, self.transfer, self.kv_bytes_per_token,
                                                    self.name, self.meta))

    def timing(self, new_tokens: float, cached_tokens: float) -> PipelineTiming:
        """pipeline_timing with this model's group (times multiplied by `scale`)."""
        t = pipeline_timing(self._base, new_tokens, cached_tokens, self.stages, self.chunk_tokens,
                            self.hidden_bytes_per_token)
        if self.scale == 1.0:
            return t
        return PipelineTiming(t.latency_s * self.scale, t.occupancy_s * self.scale, t.chunks)

    def prefill_s(self, new_tokens: float, cached_tokens: float) -> float:
        """The group's pipelined prefill latency, seconds."""
        return self.timing(new_tokens, cached_tokens).latency_s


# Paper section 3.3: chunked pipelined prefill applies when the uncached part exceeds a
# threshold, "typically above 1,000 tokens"; below it one chunk gains nothing.
CPP_MIN_TOKENS = 1000


@dataclass(frozen=True)
class GroupChoice:
    """The better of a CPP group and the best single prefill node for one request."""

    use_group: bool
    group_ttft_s: float
    single_ttft_s: float
    reason: str


def choose_group(uncached_tokens: int, single_ttft_s: float, group_queue_s: float,
                 group_timing: PipelineTiming, cpp_min_tokens: int = CPP_MIN_TOKENS) -> GroupChoice:
    """Sends a request to a pipeline group when its uncached part is at least
    `cpp_min_tokens` and the group's predicted TTFT (its queue, seconds, plus the
    pipelined latency) beats the best single node's predicted TTFT (Algorithm 1's
    estimate: transfer + queue + prefill, seconds). Ties go to the single node (fewer
    nodes busy, no hops).
    """
    group = group_queue_s + group_timing.latency_s
    if uncached_tokens < cpp_min_tokens:
        return GroupChoice(False, group, single_ttft_s, f"uncached {uncached_tokens} < {cpp_min_tokens}")
    if group < single_ttft_s:
        return GroupChoice(True, group, single_ttft_s, "group predicted faster")
    return GroupChoice(False, group, single_ttft_s, "single node predicted as fast or faster")
