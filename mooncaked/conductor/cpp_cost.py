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

Learned per-stage step times (the conductor's GroupLearner, cpp_place.py): stage k runs
chunk i in f_k * s_i, f_k its measured / predicted per-chunk time (its layer share, its
node's speed). Chunks go through the stages in order, one at a time per stage, so the
slowest stage m sets the steady state and every other stage adds one chunk's time to the
fill (the stages before m: their first chunk) or the drain (the stages after m: the last
chunk); with max_i s_i for that chunk (exact when chunks take equal time, the upper bound
when they grow with their context):

    latency   = f_m * sum_i s_i + sum_{k != m} f_k * max_i s_i + (stages - 1) * hop(x_max)
    occupancy = f_m * sum_i s_i                                     the slowest stage's busy time

With every f_k = 1 this is the formula above. `stage_timing` computes it from per-stage
per-chunk seconds (predicted or measured), `chunk_stage_seconds` gives the s_i.
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


def chunk_stage_seconds(cost: CostModel, new_tokens: float, cached_tokens: float, stages: int,
                        chunk_tokens: int) -> tuple[float, ...]:
    """s_i: each chunk's predicted seconds on one of `stages` equal stages,
    P(x_i new, c_i cached) / stages, in chunk order (() for no new tokens).
    Raises: ValueError for stages < 1 or chunk_tokens < 1."""
    if stages < 1 or chunk_tokens < 1:
        raise ValueError("stages and chunk_tokens must be >= 1")
    out, done = [], 0.0
    while done < new_tokens:
        x = min(chunk_tokens, new_tokens - done)
        out.append(cost.prefill_s(x, cached_tokens + done) / stages)
        done += x
    return tuple(out)


def stage_timing(per_stage: tuple[tuple[float, ...], ...] | list, hop_s: float) -> PipelineTiming:
    """Latency and occupancy of a pipeline whose stage k runs chunk i in per_stage[k][i]
    seconds, with hop_s seconds per stage boundary (see the module doc: the slowest stage's
    total, plus one chunk (its largest) of each other stage, plus the hops).
    Raises: ValueError when the stages' chunk counts differ."""
    per_stage = [tuple(st) for st in per_stage]
    if not per_stage or not per_stage[0]:
        return PipelineTiming(0.0, 0.0, 0)
    n = len(per_stage[0])
    if any(len(st) != n for st in per_stage):
        raise ValueError(f"every stage needs the same chunk count, got {[len(st) for st in per_stage]}")
    totals = [sum(st) for st in per_stage]
    slow = max(range(len(per_stage)), key=totals.__getitem__)
    bubble = sum(max(st) for k, st in enumerate(per_stage) if k != slow)
    return PipelineTiming(totals[slow] + bubble + (len(per_stage) - 1) * hop_s, totals[slow], n)


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
    scale: float = 1.0      # measured / modelled wall time: the group's overheads (GroupLearner)
    stage_factors: tuple[float, ...] = ()   # f_k: measured / predicted chunk time per stage

    @classmethod
    def of(cls, base: CostModel, stages: int, chunk_tokens: int, hidden_bytes_per_token: int,
           scale: float = 1.0, stage_factors: tuple[float, ...] = ()) -> PipelinedCostModel:
        """Wraps `base` (copied field by field); `stage_factors` (one per stage, or () for
        all 1) scale each stage's chunk times, `scale` the resulting pipelined times.
        Raises ValueError for stages/chunk < 1, scale <= 0, or factors of the wrong count
        or not > 0."""
        if stages < 1 or chunk_tokens < 1 or hidden_bytes_per_token < 0 or not scale > 0:
            raise ValueError("stages and chunk_tokens must be >= 1, hidden bytes >= 0, scale > 0")
        if stage_factors and (len(stage_factors) != stages or not all(f > 0 for f in stage_factors)):
            raise ValueError(f"stage_factors must be {stages} positive numbers, got {stage_factors}")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)}
        return cls(**fields, stages=stages, chunk_tokens=chunk_tokens,
                   hidden_bytes_per_token=hidden_bytes_per_token, scale=scale,
                   stage_factors=tuple(stage_factors))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_base", CostModel(self.prefill, self.decode, self.transfer, self.kv_bytes_per_token,
                                                    self.name, self.meta))

    def hop_s(self, new_tokens: float) -> float:
        """One stage boundary's hidden-state transfer of the largest chunk, seconds."""
        if self.stages == 1 or new_tokens <= 0:
            return 0.0
        return self.transfer.seconds(min(self.chunk_tokens, new_tokens) * self.hidden_bytes_per_token)

    def timing(self, new_tokens: float, cached_tokens: float) -> PipelineTiming:
        """pipeline_timing with this model's group, with the learned per-stage factors
        (stage_timing) when it has them; times multiplied by `scale`."""
        if self.stage_factors:
            s = chunk_stage_seconds(self._base, new_tokens, cached_tokens, self.stages, self.chunk_tokens)
            t = stage_timing([tuple(f * x for x in s) for f in self.stage_factors], self.hop_s(new_tokens))
        else:
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
