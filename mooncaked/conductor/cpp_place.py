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
fetch + pipelined prefill of the uncached part), then `choose_group` picks it when the
single node's uncached part is at least `cpp_min_tokens` and the group beats the single
node's predicted TTFT.

A group's prefix (`group_prefix`): each stage stores its layers' slices of finished blocks
under `store.keys.slice_key` (cluster/stage_prefix.py), so the index knows each stage's
own prefix; a stage can also READ its layers' byte range of full blocks from a fetch
source (a single prefill node, cache or decode node in the index). A stage's prefix is the
longer of its own and the best source's; the group's is the least of its stages'. Each
stage fetches only its missing blocks' share of the bytes (its layers / all layers of a
block), all stages at once, so the fetch takes the slowest stage's transfer time (for an
even split and equal own prefixes, a whole-block fetch's time divided by the stages).
A cluster whose only prefill capacity is groups sends every prompt to a group (a short
prompt is one chunk). Pure functions over the conductor's NodeViews: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import random as _random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cost_model import CostModel
from .cpp_cost import PipelinedCostModel, choose_group
from .policy import Fetch, Placement, PlacementRequest, PolicyConfig, Rejection, Snapshot, place


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
    layers: tuple[tuple[int, int], ...] = ()   # each stage's [start, stop)
    num_layers: int = 0                         # the whole model's
    block_bytes: int = 0                        # a full block (every layer), bytes

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
        layers = []
        for _, _, v in members:
            lay = stage_info(v.info).get("layers") or [0, 0]
            layers.append((int(lay[0]), int(lay[1])))
        groups.append(Group(name, tuple(v for _, _, v in members), int(c.get("chunk_tokens", 512)),
                            int(c.get("hidden_bytes_per_token", 0)), int(c.get("max_tokens", 1 << 30)),
                            tuple(layers), int(c.get("num_layers", 0)), int(c.get("block_bytes", 0))))
    return singles, groups


@dataclass(frozen=True)
class GroupPrefix:
    """A request's prefix on a CPP group (see the module doc), in blocks.

    blocks: the group's prefix (the least any stage can have); own: each stage's own
    (its store's slices, as the index has them); source: the node whose full blocks the
    stages READ by byte range (None: no stage fetches); first_block: the lowest block a
    stage fetches; fetch_blocks / fetch_bytes: per stage, what it fetches.
    """

    blocks: int
    own: tuple[int, ...]
    source: Hashable | None
    first_block: int
    fetch_blocks: tuple[int, ...]
    fetch_bytes: tuple[int, ...]

    def fetch_s(self, cost: CostModel) -> float:
        """Seconds until every stage has its share: they fetch in parallel, so the
        slowest stage's transfer time (0 without a fetch)."""
        return max((cost.transfer.seconds(b) for b in self.fetch_bytes), default=0.0)


def group_prefix(own_blocks: Sequence[int], holders: Sequence[Hashable],
                 holder_blocks: Sequence[int], stage_layers: Sequence[tuple[int, int]],
                 num_layers: int, block_bytes: int) -> GroupPrefix:
    """A group's prefix for one request (see the module doc).

    Args:
        own_blocks: per stage, its own prefix of the request's blocks (slice keys in the
            index: PrefixIndex.match of slice_key(key, start, stop) on that stage).
        holders / holder_blocks: nodes holding full blocks the stages may READ from (single
            prefill nodes, cache and decode nodes) and their prefix of the request's
            keys; on a tie the first listed serves.
        stage_layers: per stage, its [start, stop) layers; num_layers: the model's;
            block_bytes: a full block's bytes (every layer).
    Returns: GroupPrefix. Raises: ValueError when the per-stage columns differ in length.
    """
    if len(own_blocks) != len(stage_layers) or len(holders) != len(holder_blocks):
        raise ValueError("group_prefix columns differ in length")
    best = max(holder_blocks, default=0)
    source = holders[list(holder_blocks).index(best)] if best > 0 else None
    blocks = min((max(o, best) for o in own_blocks), default=0)
    fetch = tuple(max(0, blocks - o) for o in own_blocks)
    share = [(b - a) / num_layers if num_layers > 0 else 0.0 for a, b in stage_layers]
    fetch_bytes = tuple(int(f * block_bytes * sh) for f, sh in zip(fetch, share))
    if not any(fetch):
        source = None
    first = min((o for o, f in zip(own_blocks, fetch) if f), default=blocks)
    return GroupPrefix(blocks, tuple(own_blocks), source, first, fetch, fetch_bytes)


def _group_snapshot(snap: Snapshot, head_id: Any, queue_s: float, prefix_blocks: int = 0) -> Snapshot:
    """`snap` with the group's head as the only prefill node holding the group's prefix
    (no fetch sources: the group's fetch is in `queue_s`); the decode side is unchanged."""
    return dataclasses.replace(snap, prefill_nodes=[head_id], prefill_queue_s=[queue_s],
                               prefix_blocks=[prefix_blocks],
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
                      learner: GroupLearner | None = None,
                      own_blocks: Mapping[str, Sequence[int]] | None = None) -> Placement | Rejection | None:
    """The better of `single` (Algorithm 1 over the single prefill nodes; None when there
    are none) and the fastest group (see the module doc).

    Args:
        snap: the snapshot `single` was placed with (its decode side is reused; its prefill
            nodes and holders, with their prefix matches, are the groups' fetch sources;
            with no single prefill node, any prefill columns: they are replaced).
        queue_s: a node's predicted queued prefill work under a cost model, seconds
            (load.queue_s).
        learner: scales each group's pipelined prediction by what it measured (None: 1).
        own_blocks: group name -> each stage's own prefix of req.keys in blocks (its
            store's slices; None or a missing group: none).
    Returns: a Placement naming a group's head as prefill node (its prefix, and the
    fetch the stages make as `fetch` with the transfer time), `single` unchanged, or a
    Rejection (the group's, when there is no single node). None only when `single` is
    None and there are no groups.
    """
    n = req.prompt_tokens
    best: Placement | None = None
    best_cost: PipelinedCostModel | None = None
    rejected: Rejection | None = None
    # full blocks the stages may READ: holders first (cache nodes: they spare a prefill
    # node's transfers), then the single prefill nodes
    holders = [*snap.holder_nodes, *snap.prefill_nodes]
    holder_blocks = [*snap.holder_prefix_blocks, *snap.prefix_blocks]
    for g in groups:
        if n > g.max_tokens:
            continue
        gcost = PipelinedCostModel.of(cost, len(g.stages), g.chunk_tokens, g.hidden_bytes_per_token,
                                      learner.scale(g.name) if learner is not None else 1.0)
        own = tuple((own_blocks or {}).get(g.name) or (0,) * len(g.stages))
        layers = g.layers or tuple((0, 0) for _ in g.stages)
        gp = group_prefix(own, holders, holder_blocks, layers, g.num_layers, g.block_bytes)
        fetch_s = gp.fetch_s(cost)
        r = place(req, _group_snapshot(snap, g.head.node_id, queue_s(g.head, gcost) + fetch_s,
                                       gp.blocks), gcost, cfg, rng)
        if isinstance(r, Rejection):
            rejected = rejected or r
            continue
        fetch = None
        if gp.source is not None:
            lo, hi = gp.first_block, gp.blocks
            fetch = Fetch(gp.source, lo, tuple(req.keys[lo:hi]),
                          min(hi * cfg.block_size, n) - min(lo * cfg.block_size, n))
        r = dataclasses.replace(r, local_prefix_blocks=min(own, default=0), fetch=fetch,
                                predicted_queue_s=r.predicted_queue_s - fetch_s,
                                predicted_transfer_s=fetch_s)
        if best is None or r.predicted_ttft_s < best.predicted_ttft_s:
            best, best_cost = r, gcost
    if not isinstance(single, Placement):
        return best if best is not None else (rejected or single)
    if best is None:
        return single
    uncached = n - single.prefix_tokens
    choice = choose_group(uncached, single.predicted_ttft_s,
                          best.predicted_queue_s + best.predicted_transfer_s,
                          best_cost.timing(n - best.prefix_tokens, best.prefix_tokens),
                          cpp_min_tokens)
    return best if choice.use_group else single


__all__ = ["Group", "GroupLearner", "GroupPrefix", "group_prefix", "place_with_groups", "split_groups",
           "stage_info"]
