"""Placement on chunked-pipeline-parallel (CPP) groups (Mooncake section 3.3), beside
Algorithm 1: which prefill nodes form complete groups, and whether a request goes to a
group or to the best single prefill node.

A stage node registers as a prefill node whose member record carries `cpp` = {group,
stage, stages, layers, chunk_tokens, hidden_bytes_per_token, ...} (cluster/cpp_node.py).
`split_groups` takes the live prefill nodes apart into single nodes and complete groups
(every stage 0..stages-1 live, not draining, agreeing on the group size). `place_with_groups`
runs Algorithm 1 (policy.place) once per group with the group as one prefill node whose
cost model is the pipelined one (cpp_cost.PipelinedCostModel: per-chunk stage time plus
the fill and drain bubble), so the group's TTFT estimate is Algorithm 1's own (queue +
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
    request alone), and so is a node without a member record (no control address)."""
    singles, by_group = [], {}
    for v in prefill:
        if not v.info.get("control"):
            # known only from its report (its member record not seen yet, e.g. right after a
            # restart): whether it is a stage is unknown, and it cannot be reached anyway
            continue
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


def place_with_groups(single: Placement | Rejection | None, groups: Sequence[Group],
                      req: PlacementRequest, snap: Snapshot, cost: CostModel, cfg: PolicyConfig,
                      rng: _random.Random | None, cpp_min_tokens: int,
                      queue_s: Callable[[Any, CostModel], float]) -> Placement | Rejection | None:
    """The better of `single` (Algorithm 1 over the single prefill nodes; None when there
    are none) and the fastest group (see the module doc).

    Args:
        snap: the snapshot `single` was placed with (its decode side is reused; with no
            single prefill node, any prefill columns: they are replaced).
        queue_s: a node's predicted queued prefill work under a cost model, seconds
            (load.queue_s).
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
        gcost = PipelinedCostModel.of(cost, len(g.stages), g.chunk_tokens, g.hidden_bytes_per_token)
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


__all__ = ["Group", "place_with_groups", "split_groups", "stage_info"]
