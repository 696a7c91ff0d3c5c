"""Placement on chunked-pipeline-parallel (CPP) groups (Mooncake section 3.3), beside
Algorithm 1: which prefill nodes form complete groups, and whether a request goes to a
group or to the best single prefill node.

A stage node registers as a prefill node whose member record carries `cpp` = {group,
stage, stages, layers, chunk_tokens, hidden_bytes_per_token, ...} (cluster/cpp/cpp_node.py).
`split_groups` takes the live prefill nodes apart into single nodes and complete groups
(every stage 0..stages-1 live, not draining, agreeing on the group size). `place_with_groups`
runs Algorithm 1 (policy.place) once per group with the group as one prefill node whose
cost model is the pipelined one (cpp_cost.PipelinedCostModel: per-chunk stage time plus
the fill and drain bubble, with each stage's chunk times and the group's overhead learned
from its measured steps: GroupLearner), so the group's TTFT estimate is Algorithm 1's own (queue +
fetch + pipelined prefill of the uncached part), then `choose_group` picks it when the
single node's uncached part is at least `cpp_min_tokens` and the group beats the single
node's predicted TTFT.

A group's prefix (`group_prefix`): each stage stores its layers' slices of finished blocks
under `store.keys.slice_key` (cluster/cpp/stage_prefix.py), so the index knows each stage's
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
from .cpp_cost import PipelinedCostModel, choose_group, chunk_stage_seconds, stage_timing
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


def stalled_groups(groups: Sequence[Group]) -> dict[str, dict[str, str]]:
    """The groups that cannot take a request now: group name -> {stage node: why}, from the
    stages' reports (NodeView.stalled: slots held without progress, a hung chunk). A
    stalled group is complete but not placed on (issue 32)."""
    out = {}
    for g in groups:
        why = {v.node_id: v.stalled for v in g.stages if getattr(v, "stalled", "")}
        if why:
            out[g.name] = why
    return out


def usable_groups(groups: Sequence[Group]) -> list[Group]:
    """The groups placement may use: complete and not stalled (stalled_groups)."""
    stalled = stalled_groups(groups)
    return [g for g in groups if g.name not in stalled]


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


def stage_factor_sample(predicted: tuple[float, ...], measured: tuple[tuple[float, ...], ...]
                        ) -> tuple[float, ...] | None:
    """One request's f_k per stage: the stage's measured chunk seconds over its predicted
    ones (chunk_stage_seconds at placement), as a ratio of sums (one slow chunk moves it
    by its share only). None when a stage's chunk count differs from the prediction's or
    a total is not positive (a different chunking, a prefix hit: not comparable)."""
    total = sum(predicted)
    if not measured or total <= 0 or any(len(st) != len(predicted) for st in measured):
        return None
    out = tuple(sum(st) / total for st in measured)
    return out if all(f > 0 for f in out) else None


def fold_factors(old: tuple[float, ...], sample: tuple[float, ...], alpha: float,
                 bounds: tuple[float, float]) -> tuple[float, ...]:
    """The exponentially weighted mean of per-stage factors: each sample entry clamped to
    `bounds`, weight `alpha` on the sample; `old` of another length (none yet, or the group
    changed its stage count) is replaced by the sample."""
    clamped = tuple(min(max(f, bounds[0]), bounds[1]) for f in sample)
    if len(old) != len(clamped):
        return clamped
    return tuple((1 - alpha) * o + alpha * f for o, f in zip(old, clamped, strict=True))


def group_chunk_prediction(cost: CostModel, group: Group, prompt_tokens: int
                           ) -> tuple[tuple[float, ...], float]:
    """What the GroupLearner compares a group's measured steps with: (each chunk's
    predicted seconds on one equal stage, the hop seconds) for an uncached prompt."""
    gcost = PipelinedCostModel.of(cost, len(group.stages), group.chunk_tokens, group.hidden_bytes_per_token)
    return (chunk_stage_seconds(cost, prompt_tokens, 0, len(group.stages), group.chunk_tokens),
            gcost.hop_s(prompt_tokens))


class GroupLearner:
    """Learns each group's per-stage step times and overhead from its measured prefills (the
    stage-0 node's finished prefills, reported like any prefill node's, with every stage's
    per-chunk compute seconds: PrefillDone.stages). Per group:

    - `factors(group)`: f_k per stage, an exponentially weighted mean of measured / predicted
      chunk seconds (stage_factor_sample); a stage with more layers or a slower node learns
      a larger f_k, and PipelinedCostModel's stage_timing makes the slowest stage dominate.
      Every uncached prefill counts, also one that shared the group with another request
      (a stage's compute thread runs one chunk at a time, so its chunk times stay true).
    - `scale(group)`: the overhead, measured wall seconds / stage_timing of the measured
      chunk times (hops, RPCs, the decode node's reservation, KV push waits): an exponentially
      weighted mean over uncached prefills that had the group to themselves (a shared one's
      wall time includes its queue).

    So the group's prediction is scale * stage_timing(f_k * s_i): the whole-group scale of
    before (measured / predicted) is scale * f when the stages are alike, and the per-stage
    factors also say which stage is the bottleneck. Pure bookkeeping: no clock, no I/O.

    Args: alpha: weight of the newest sample (0 < alpha <= 1); bounds: each factor's and
        the scale's range.
    """

    MAX_PENDING = 10_000   # predictions kept awaiting their measurement (oldest dropped)

    def __init__(self, alpha: float = 0.3, bounds: tuple[float, float] = (0.1, 10.0)):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.bounds = alpha, bounds
        self.scales: dict[str, float] = {}
        self.samples: dict[str, int] = {}               # overhead samples
        self.stage_factors: dict[str, tuple[float, ...]] = {}
        self.stage_samples: dict[str, int] = {}
        self._pending: dict[str, tuple[str, tuple[float, ...], float]] = {}
        self._running: dict[str, set[str]] = {}      # group -> rids placed, not yet measured
        self._shared: set[str] = set()               # rids that overlapped another on a group

    def predicted(self, rid: str, group: str, chunk_s: tuple[float, ...], hop_s: float = 0.0) -> None:
        """Remembers what the group's model predicts for request rid: each chunk's seconds on
        one equal stage and the hop seconds (group_chunk_prediction)."""
        if not chunk_s or sum(chunk_s) <= 0:
            return
        self._pending[rid] = (group, tuple(chunk_s), float(hop_s))
        running = self._running.setdefault(group, set())
        if running:
            self._shared.update(running)
            self._shared.add(rid)
        running.add(rid)
        while len(self._pending) > self.MAX_PENDING:
            self._forget(next(iter(self._pending)))

    def _forget(self, rid: str) -> tuple[str, tuple[float, ...], float] | None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            self._running.get(entry[0], set()).discard(rid)
        self._shared.discard(rid)
        return entry

    def observe(self, rid: str, seconds: float, cached_tokens: int = 0,
                stages: tuple[tuple[float, ...], ...] = ()) -> None:
        """Folds in rid's measured prefill: wall seconds and `stages` (per stage, each
        chunk's compute seconds). Ignored for other requests, cached ones, and reports
        without comparable chunk times."""
        shared = rid in self._shared
        entry = self._forget(rid)
        if entry is None or seconds <= 0 or cached_tokens:
            return
        group, chunk_s, hop_s = entry
        sample = stage_factor_sample(chunk_s, stages)
        if sample is None:
            return
        self.stage_factors[group] = fold_factors(self.stage_factors.get(group, ()), sample, self.alpha,
                                                 self.bounds)
        self.stage_samples[group] = self.stage_samples.get(group, 0) + 1
        modelled = stage_timing(stages, hop_s).latency_s
        if shared or modelled <= 0:
            return
        ratio = min(max(seconds / modelled, self.bounds[0]), self.bounds[1])
        old = self.scales.get(group)
        self.scales[group] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
        self.samples[group] = self.samples.get(group, 0) + 1

    def scale(self, group: str) -> float:
        """The group's learned overhead scale (1.0 before any sample)."""
        return self.scales.get(group, 1.0)

    def factors(self, group: str, stages: int | None = None) -> tuple[float, ...]:
        """The group's learned per-stage factors; () before any sample, or when they were
        learned for another stage count than `stages`."""
        f = self.stage_factors.get(group, ())
        return f if stages is None or len(f) == stages else ()

    def status(self) -> dict:
        """{group: {scale, samples, stage_factors, stage_samples}} for conductor.status."""
        return {g: {"scale": round(self.scales.get(g, 1.0), 4), "samples": self.samples.get(g, 0),
                    "stage_factors": [round(f, 4) for f in self.stage_factors.get(g, ())],
                    "stage_samples": self.stage_samples.get(g, 0)}
                for g in sorted(set(self.scales) | set(self.stage_factors))}


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
        learner: each group's learned per-stage factors and overhead scale (None: none).
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
                                      learner.scale(g.name) if learner is not None else 1.0,
                                      learner.factors(g.name, len(g.stages)) if learner is not None else ())
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


__all__ = ["Group", "GroupLearner", "GroupPrefix", "fold_factors", "group_chunk_prediction", "group_prefix",
           "place_with_groups", "split_groups", "stage_factor_sample", "stage_info"]
