"""Placement on chunked-pipeline-parallel (CPP) groups (Mooncake section 3.3), beside
Algorithm 1: which prefill nodes form complete groups, and whether a request goes to a
group or to the best single prefill node.

A stage node registers as a prefill node whose member record carries `cpp` = {group,
stage, stages, layers, chunk_tokens, hidden_bytes_per_token, ...} (cluster/cpp_node.py).
`split_groups` takes the live prefill nodes apart into single nodes and complete groups
(every stage 0..stages-1 live, not draining, agreeing on the group size). `place_with_groups`
runs Algorithm 1 (policy.place) once per group with the group as one prefill node whose
cost model is the pipelined one (cpp_cost.PipelinedCostModel: per-chunk stage time plus
the fill and drain bubble, scaled by what the group measured: GroupLearner), so the group's TTFT estimate is Algorithm 1's own (queue +
pipelined prefill; a group has no prefix cache), then `choose_group` picks it when the
uncached part is at least `cpp_min_tokens` and it beats the single node's predicted TTFT.
A cluster whose only prefill capacity is groups sends every prompt to a group (a short
prompt is one chunk). Pure functions over the conductor's NodeViews: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .cost_model import CostModel
from .cpp_cost import PipelinedCostModel, choose_group
from .policy import Placement, PlacementRequest, PolicyConfig, Rejection, Snapshot, place


def stage_info(info: dict) -> dict | None:
    """The `cpp` entry of a member record (group, stage, stages, layers, ...), or None for
    a node that is not a pipeline stage."""
    c = info.get("cpp") if isinstance(info, dict) else None
    return c if isinstance(c, dict) and c.get("group") else None


@dataclass(frozen=True)
class Group:
    """A complete CPP group: its stages in order (NodeViews; stages[0] takes requests)."""

    name: str
    stages: tuple[Any, ...]
    chunk_tokens: int
    hidden_bytes_per_token: int
    max_tokens: int

    @property
    def head(self) -> Any:
        """Stage 0, the node a placement names as the prefill node."""
        return self.stages[0]


def split_groups(prefill: Sequence[Any]) -> tuple[list[Any], list[Group]]:
    """(single prefill nodes, complete groups) of the live prefill NodeViews (each with
    `.info`). A group counts only when stages 0..stages-1 are all among `prefill` and
    agree on `stages`; stages of an incomplete group are dropped (they cannot run a
    request alone). A node the conductor knows only from its report (its member record
    not seen yet, e.g. right after a restart) counts as a single node: if it is in fact a
    later stage it refuses with StageFailure and the request is placed again without it."""
    singles, by_group = [], {}
    for v in prefill:
        c = stage_info(v.info)
        if c is None:
            singles.append(v)
        else:
            by_group.setdefault(str(c["group"]), []).append((int(c["stage"]), int(c["stages"]), v))
    groups = []
    for name, members in sorted(by_group.items()):
        members.sort(key=lambda t: t[0])
        n = members[0][1]
        if [s for s, _, _ in members] != list(range(n)) or any(k != n for _, k, _ in members):
            continue
        c = stage_info(members[0][2].info)
        groups.append(Group(name, tuple(v for _, _, v in members), int(c.get("chunk_tokens", 512)),
                            int(c.get("hidden_bytes_per_token", 0)), int(c.get("max_tokens", 1 << 30))))
    return singles, groups


def _group_snapshot(snap: Snapshot, head_id: Any, queue_s: float) -> Snapshot:
    """`snap` with the group's head as the only prefill node (no prefix, no fetch sources):
    the decode side is unchanged."""
    return dataclasses.replace(snap, prefill_nodes=[head_id], prefill_queue_s=[queue_s], prefix_blocks=[0],
                               holder_nodes=[], holder_prefix_blocks=[], prefill_queued_s=(),
                               prefill_busy_s=(), holder_busy_s=(), pending_prefix_blocks=(),
                               pending_ready_s=())


class GroupLearner:
    """Learns each group's pipelined prefill time from its measured prefills (the stage-0
    node's finished prefills, reported like any prefill node's): per group, an
    exponentially weighted mean of measured / predicted seconds, which scales the group's
    PipelinedCostModel (so per-chunk stage time, bubble and hop costs the model gets wrong
    for this group are corrected as a whole). Only uncached prefills that had the group to
    themselves count (the prediction assumes no cached prefix, and excludes the queue).
    Pure bookkeeping: no clock, no I/O.

    Args: alpha: weight of the newest sample (0 < alpha <= 1); bounds: the scale's range.
    """

    MAX_PENDING = 10_000   # predictions kept awaiting their measurement (oldest dropped)

    def __init__(self, alpha: float = 0.3, bounds: tuple[float, float] = (0.1, 10.0)):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.bounds = alpha, bounds
        self.scales: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self._pending: dict[str, tuple[str, float]] = {}
        self._running: dict[str, set[str]] = {}      # group -> rids placed, not yet measured
        self._shared: set[str] = set()               # rids that overlapped another on a group

    def predicted(self, rid: str, group: str, seconds: float) -> None:
        """Remembers the group's predicted prefill seconds (at scale 1) for request rid."""
        if seconds <= 0:
            return
        self._pending[rid] = (group, seconds / self.scale(group))
        running = self._running.setdefault(group, set())
        if running:
            self._shared.update(running)
            self._shared.add(rid)
        running.add(rid)
        while len(self._pending) > self.MAX_PENDING:
            self._forget(next(iter(self._pending)))

    def _forget(self, rid: str) -> tuple[str, float] | None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            self._running.get(entry[0], set()).discard(rid)
        self._shared.discard(rid)
        return entry

    def observe(self, rid: str, seconds: float, cached_tokens: int = 0) -> None:
        """Folds in rid's measured prefill seconds (ignored for other requests, cached ones
        and non-positive times)."""
        shared = rid in self._shared
        entry = self._forget(rid)
        if entry is None or seconds <= 0 or cached_tokens or shared:
            return
        group, predicted = entry
        ratio = min(max(seconds / predicted, self.bounds[0]), self.bounds[1])
        old = self.scales.get(group)
        self.scales[group] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
        self.samples[group] = self.samples.get(group, 0) + 1

    def scale(self, group: str) -> float:
        """The group's learned scale (1.0 before any sample)."""
        return self.scales.get(group, 1.0)

    def status(self) -> dict:
        """{group: {scale, samples}} for conductor.status."""
        return {g: {"scale": round(s, 4), "samples": self.samples.get(g, 0)}
                for g, s in sorted(self.scales.items())}


def place_with_groups(single: Placement | Rejection | None, groups: Sequence[Group],
                      req: PlacementRequest, snap: Snapshot, cost: CostModel, cfg: PolicyConfig,
                      rng: _random.Random | None, cpp_min_tokens: int,
                      queue_s: Callable[[Any, CostModel], float],
                      learner: GroupLearner | None = None) -> Placement | Rejection | None:
    """The better of `single` (Algorithm 1 over the single prefill nodes; None when there
    are none) and the fastest group (see the module doc).

    Args:
        snap: the snapshot `single` was placed with (its decode side is reused; with no
            single prefill node, any prefill columns: they are replaced).
        queue_s: a node's predicted queued prefill work under a cost model, seconds
            (load.queue_s).
        learner: scales each group's pipelined prediction by what it measured (None: 1).
    Returns: a Placement naming a group's head as prefill node, `single` unchanged, or a
    Rejection (the group's, when there is no single node). None only when `single` is
    None and there are no groups.
    """
    n = req.prompt_tokens
    best: Placement | None = None
    best_cost: PipelinedCostModel | None = None
    rejected: Rejection | None = None
    for g in groups:
        if n > g.max_tokens:
            continue
        gcost = PipelinedCostModel.of(cost, len(g.stages), g.chunk_tokens, g.hidden_bytes_per_token,
                                      learner.scale(g.name) if learner is not None else 1.0)
        r = place(req, _group_snapshot(snap, g.head.node_id, queue_s(g.head, gcost)), gcost, cfg, rng)
        if isinstance(r, Rejection):
            rejected = rejected or r
        elif best is None or r.predicted_ttft_s < best.predicted_ttft_s:
            best, best_cost = r, gcost
    if not isinstance(single, Placement):
        return best if best is not None else (rejected or single)
    if best is None:
        return single
    uncached = n - single.prefix_tokens
    choice = choose_group(uncached, single.predicted_ttft_s, best.predicted_queue_s,
                          best_cost.timing(n, 0), cpp_min_tokens)
    return best if choice.use_group else single


__all__ = ["Group", "GroupLearner", "place_with_groups", "split_groups", "stage_info"]
