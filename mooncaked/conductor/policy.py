"""Placement: which prefill node and which decode node serve a request (Mooncake Algorithm 1).

`place(request, snapshot, cost, config, rng)` is a pure function: no I/O, no clock,
no asyncio. The live conductor and the simulator call it with their own snapshots.

Policies (Mooncake paper, sections 4.1 and 4.2, Figure 5):
- ``random``: any prefill node, uniformly (needs `rng`).
- ``load_balancing``: the prefill node with the least queued work.
- ``local_cache_aware``: lowest predicted TTFT = queue + prefill, where each node can
  only reuse the prefix it holds itself.
- ``global_cache_aware``: Algorithm 1 with cache load balancing. With best_len the
  longest prefix any node holds: a node whose own prefix is much shorter
  (best_len / own_len > threshold) may fetch the missing blocks from the holder,
  if transfer + prefill(best_len) beats prefill(own_len) (else it recomputes);
  TTFT = transfer + queue + prefill; the lowest TTFT wins. Holders that do not
  prefill (cache nodes) count as sources too. Fetching replicates hot blocks onto
  more nodes (section 4.2). Transfers run at the cost model's rate, or over a path
  measured into the node (`Snapshot.path_bytes_per_s`) at that path's rate; each node
  then fetches from the holder of best_len behind its fastest path (the cost rule
  below: the holder with its lowest busy + transfer).

- ``cost_aware`` (beyond Algorithm 1): the global policy with its three hand-set or
  blind parts replaced by predictions, each also available alone as an option of
  PolicyConfig so that Algorithm 1 stays reproducible as is:
  fetch_rule ``cost`` (fetch or recompute by predicted time, no ratio threshold: every
  prefix length held anywhere is a candidate, fetched from its least busy holder, and
  the fetch overlaps the node's queue wait: TTFT = max(wait, busy + transfer) + prefill),
  prefill_order ``spf`` (the prefill queue runs the shortest predicted prefill first,
  except that a request waiting aging_s or longer goes first in arrival order: the
  starvation bound; the wait a new request sees is the running remainder plus the
  queued prefills no longer than its own, `spf_wait_s`), and decode_rule ``kv_aware``
  (`choose_decode`: the lowest step time after admission, counting the KV the request
  will hold at its end, among nodes keeping room for another request of its size).
  Under shortest-first queues a node scores its TTFT plus the delay the request causes
  to the queued ones it overtakes. With the cost rule a node may also wait for a prefix
  that a prefill queued there is about to store (Snapshot.pending_*): under load the
  next turn of a conversation often arrives before the previous turn has run.
  Two more options, also defaults of ``cost_aware``: fcfs_slack_s (10 s), an adaptive
  starvation bound for the shortest-first queue (a request also goes first once it has
  waited the FCFS wait it saw on arrival plus the slack, `spf_bound_s`), with the slack at
  most fcfs_slack_ratio (1) x that FCFS wait and the bound kept on the start time
  (spf_bound_rule "start", `spf_pick`: a shorter prefill runs only if it ends before every
  waiting request's bound), and
  pipeline_stages (2), elastic chunked pipeline parallelism per request (section 3.3):
  a long prompt may run over up to that many prefill nodes with nothing queued when
  that is predicted faster than the best single node, charging the node time the
  pipeline holds idle to every node with requests queued (`_pipeline_choice`; needs
  Snapshot.prefill_free_s, which only the simulator fills today).

For every other policy the decode node is the one with the lowest predicted step time
(batch + 1, context + prompt) among those with KV room (decode_rule ``step``), and the
request is rejected early (HTTP 429 with Retry-After) when the predicted TTFT or TBT
breaks its SLO (section 4, step 4; section 7 on overload).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random as _random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .cost_model import CostModel
from .cpp_cost import CPP_MIN_TOKENS, PipelineTiming, pipeline_timing

POLICIES = ("random", "load_balancing", "local_cache_aware", "global_cache_aware", "cost_aware")
FETCH_RULES = ("threshold", "cost")
# whether a prefix held elsewhere is fetched: as the fetch rule predicts (adaptive), or
# always / never (the fixed baselines the adaptive rule is measured against)
FETCH_POLICIES = ("adaptive", "always", "never")
DECODE_RULES = ("step", "kv_aware")
PREFILL_ORDERS = ("fcfs", "spf")
# (fetch_rule, decode_rule, prefill_order) a policy uses unless PolicyConfig overrides them
_RULE_DEFAULTS = {"cost_aware": ("cost", "kv_aware", "spf")}
_PLAIN_RULES = ("threshold", "step", "fcfs")
# PolicyConfig.pipeline_stages a policy uses unless overridden (1: never pipelines)
_PIPELINE_DEFAULTS = {"cost_aware": 2}
# PolicyConfig.fcfs_slack_s a policy uses unless overridden (inf: the aging bound only)
_FCFS_SLACK_DEFAULTS = {"cost_aware": 10.0}
# PolicyConfig.aging_s a policy uses unless overridden (else 30 s, the paper's TTFT
# threshold); cost_aware bounds each wait relative to FCFS instead (fcfs_slack_s, ratio)
_AGING_DEFAULTS = {"cost_aware": math.inf}
# PolicyConfig.fcfs_slack_ratio a policy uses unless overridden (inf: fcfs_slack_s alone)
_FCFS_SLACK_RATIO_DEFAULTS = {"cost_aware": 1.0}
# how spf_pick reads the starvation bound (PolicyConfig.spf_bound_rule)
SPF_BOUND_RULES = ("wait", "start")
_SPF_BOUND_RULE_DEFAULTS = {"cost_aware": "start"}


def policy_defaults(policy: str) -> tuple[str, str, str]:
    """(fetch_rule, decode_rule, prefill_order) of `policy` when not overridden: the
    cost-aware policy's predictions, else Algorithm 1's threshold, step-time decode
    choice and FCFS prefill queues."""
    return _RULE_DEFAULTS.get(policy, _PLAIN_RULES)


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the placement function.

    Attributes:
        policy: one of POLICIES.
        block_size: tokens per block key (512 in the Mooncake traces).
        cache_balance_threshold: a node fetches a longer prefix from another node only when
            best_len / own_len exceeds this (own_len 0 always qualifies); set by hand in the
            paper.
        ttft_slo_s, tbt_slo_s: reject when the prediction exceeds these; inf disables.
        min_retry_after_s: smallest Retry-After returned with a rejection.
        fetch_rule: "threshold" (Algorithm 1: the ratio above, then transfer + prefill
            against recompute) or "cost" (see the module doc); "" takes the policy's default.
        decode_rule: "step" or "kv_aware" (`choose_decode`); "" takes the policy's default.
        prefill_order: "fcfs" or "spf", how the prefill queues run (the simulator's and
            the placement's wait prediction, `spf_wait_s`); "" takes the policy's default.
        aging_s: with "spf", a request that has waited this long (seconds) goes before
            every younger one, in arrival order: its wait is bounded; None: the policy's
            default (30 s, the paper's TTFT threshold; inf for cost_aware, whose bound is
            relative to FCFS: fcfs_slack_s and fcfs_slack_ratio).
        fcfs_slack_s: with "spf", a request also goes first once it has waited the wait FCFS
            would have given it (the queue ahead of it when it arrived) plus this slack,
            seconds: an adaptive starvation bound, so no request starts much later than
            under Algorithm 1's FCFS queues (`spf_bound_s`); inf: aging_s only; None: the
            policy's default (10 s for cost_aware, else inf).
        fcfs_slack_ratio: with "spf", the slack is also at most this times the request's
            FCFS wait (`spf_bound_s`): a load-adaptive bound, so that where the node is
            lightly queued no request starts much later than FCFS would start it; inf: the
            fixed slack alone; None: the policy's default (1 for cost_aware, else inf).
        fetch_policy: "adaptive" (fetch or recompute as fetch_rule predicts), "always"
            (a node with a shorter prefix than the longest held anywhere fetches the
            missing blocks, whatever they cost: no ratio threshold, no comparison with
            recomputing) or "never" (each node reuses only its own prefix). The fixed two
            are the baselines the adaptive rule is measured against (`mooncake bench trace
            --hosts`); only the global policies fetch at all.
        spf_bound_rule: with "spf", "wait" (a request goes first once it has waited its
            bound; a prefill started just before can still delay it by its length) or
            "start" (the bound is on its start: a shorter prefill is run only if it ends
            before every waiting request's bound runs out, `spf_pick`); "" takes the
            policy's default ("start" for cost_aware, else "wait").
        pipeline_stages: elastic chunked pipeline parallelism (paper section 3.3): the most
            prefill nodes one request may be pipelined over when they are all idle
            (`Snapshot.prefill_idle`); 1 never pipelines; 0 takes the policy's default
            (1, or 2 for cost_aware). See `_pipeline_choice`.
        pipeline_chunk_tokens, pipeline_hidden_bytes_per_token: the pipeline's chunk
            (tokens) and the hidden state crossing a stage boundary (bytes a token;
            LLaMA3-70B: 8192 x bf16), as `cpp_cost.pipeline_timing` takes them.
        pipeline_min_tokens: only a request with at least this many uncached tokens is
            pipelined (the paper: "typically above 1,000 tokens").
        pipeline_under_load_ttft_s: while any prefill node has requests queued, a pipeline
            is taken only when it turns a TTFT miss into a hit: the best single node's
            predicted TTFT exceeds this and the pipeline's meets it (`pipeline_rescues`);
            otherwise the helper's node time goes to the queued work. Default 30 s, the
            paper's TTFT threshold; inf: never pipeline under load; 0: no such rule (the
            score alone decides).
    Raises (constructor): ValueError on an unknown policy, rule or out-of-range value.
    """

    policy: str = "global_cache_aware"
    block_size: int = 512
    cache_balance_threshold: float = 1.5
    ttft_slo_s: float = math.inf
    tbt_slo_s: float = math.inf
    min_retry_after_s: float = 1.0
    fetch_rule: str = ""
    decode_rule: str = ""
    prefill_order: str = ""
    aging_s: float | None = None
    fcfs_slack_s: float | None = None
    pipeline_stages: int = 0
    pipeline_chunk_tokens: int = 4096
    pipeline_hidden_bytes_per_token: int = 16384
    pipeline_min_tokens: int = CPP_MIN_TOKENS
    pipeline_under_load_ttft_s: float = 30.0
    fcfs_slack_ratio: float | None = None
    spf_bound_rule: str = ""
    fetch_policy: str = "adaptive"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown placement policy {self.policy!r}; choose one of "
                             f"{', '.join(POLICIES)}")
        for name, allowed, default in zip(("fetch_rule", "decode_rule", "prefill_order"),
                                          (FETCH_RULES, DECODE_RULES, PREFILL_ORDERS),
                                          policy_defaults(self.policy)):
            v = getattr(self, name) or default
            if v not in allowed:
                raise ValueError(f"unknown {name} {v!r}; choose one of {', '.join(allowed)}")
            object.__setattr__(self, name, v)
        if self.aging_s is None:
            object.__setattr__(self, "aging_s", _AGING_DEFAULTS.get(self.policy, 30.0))
        if self.fetch_policy not in FETCH_POLICIES:
            raise ValueError(f"unknown fetch_policy {self.fetch_policy!r}; choose one of "
                             f"{', '.join(FETCH_POLICIES)}")
        if not self.aging_s >= 0:
            raise ValueError(f"aging_s must be >= 0, got {self.aging_s}")
        if self.fcfs_slack_s is None:
            object.__setattr__(self, "fcfs_slack_s", _FCFS_SLACK_DEFAULTS.get(self.policy, math.inf))
        if not self.fcfs_slack_s >= 0:
            raise ValueError(f"fcfs_slack_s must be >= 0, got {self.fcfs_slack_s}")
        if self.fcfs_slack_ratio is None:
            object.__setattr__(self, "fcfs_slack_ratio",
                               _FCFS_SLACK_RATIO_DEFAULTS.get(self.policy, math.inf))
        if not self.fcfs_slack_ratio >= 0:
            raise ValueError(f"fcfs_slack_ratio must be >= 0, got {self.fcfs_slack_ratio}")
        rule = self.spf_bound_rule or _SPF_BOUND_RULE_DEFAULTS.get(self.policy, "wait")
        if rule not in SPF_BOUND_RULES:
            raise ValueError(f"unknown spf_bound_rule {rule!r}; choose one of "
                             f"{', '.join(SPF_BOUND_RULES)}")
        object.__setattr__(self, "spf_bound_rule", rule)
        if self.pipeline_stages == 0:
            object.__setattr__(self, "pipeline_stages", _PIPELINE_DEFAULTS.get(self.policy, 1))
        if (self.pipeline_stages < 1 or self.pipeline_chunk_tokens < 1
                or self.pipeline_hidden_bytes_per_token < 0 or self.pipeline_min_tokens < 0
                or not self.pipeline_under_load_ttft_s >= 0):
            raise ValueError("pipeline_stages and pipeline_chunk_tokens must be >= 1, "
                             "pipeline hidden bytes, min tokens and under-load TTFT >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.cache_balance_threshold >= 1.0:
            raise ValueError(f"cache_balance_threshold must be >= 1, got "
                             f"{self.cache_balance_threshold}")
        if not (self.ttft_slo_s > 0 and self.tbt_slo_s > 0 and self.min_retry_after_s >= 0):
            raise ValueError("SLOs must be > 0 and min_retry_after_s >= 0")


@dataclass(frozen=True)
class PlacementRequest:
    """What the conductor knows about a request.

    Attributes:
        keys: the prompt's block keys, in order (one per full block; the Mooncake traces
            also key the trailing partial block).
        prompt_tokens: prompt length, tokens.
        max_new_tokens: output tokens to reserve KV for on the decode node.
    """

    keys: Sequence[Hashable]
    prompt_tokens: int
    max_new_tokens: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Cluster state at placement time, column-wise (one entry per node in each list).

    Prefill side: `prefill_nodes` ids, `prefill_queue_s` predicted work queued on each
    (seconds, the running request's remainder included), `prefix_blocks` each node's own
    prefix match of the request's keys in blocks (`PrefixIndex.match`).
    Decode side: `decode_nodes` ids, `decode_batch` running requests, `decode_context_tokens`
    KV tokens those hold, `decode_free_kv_tokens` KV room left. An empty decode side
    places the prefill only (coupled instances, prefill-only runs).
    Holders: `holder_nodes` that lend store memory to the pool but do not prefill (cache
    nodes), with `holder_prefix_blocks` their prefix match; the global policy may fetch
    from them (preferred over a prefill node holding as much, whose compute it spares).
    Optional, used by the cost-aware rules (empty: unknown, taken as none):
    `prefill_queued_s` per prefill node the requests waiting in its queue (the running
    one excluded) as a QueuedWork (or a plain sequence of their predicted prefill
    seconds), for the shortest-first wait;
    `prefill_busy_s` and `holder_busy_s` seconds until each node's outgoing transfers
    already planned are done (queueing at a fetch source);
    `pending_prefix_blocks` per prefill node the prefix blocks of the request it will hold
    once a prefill queued or running there has stored them (>= prefix_blocks), and
    `pending_ready_s` predicted seconds until that prefill is done: a request may wait
    for a prefix still being computed instead of recomputing it (under load the next turn
    of a conversation often arrives before the previous one ran);
    `prefill_free_s` per prefill node the seconds until it can join an elastic pipeline
    (PolicyConfig.pipeline_stages): 0 when idle, the running request's remainder when
    nothing is queued behind it, inf when requests are queued (they keep their order); a
    cluster that cannot pipeline leaves it empty.
    `path_bytes_per_s`: measured bandwidth of node paths, (source, destination) -> bytes/s
    (the live conductor: destination's transfer engine's estimate for its transfers with
    source, `NodeReport.links`; see `ConductorService.path_rates`). A fetch from source s
    to prefill node i is predicted at the rate of (s, i) when measured (finite, > 0), else
    at the cost model's rate; so the best source of a prefix may differ per node (a busier
    holder behind a fast path can beat an idle one behind a slow path). Empty (the
    default, and the simulator): every path at the cost model's rate, the decisions
    exactly those made without it.
    """

    prefill_nodes: Sequence[Hashable]
    prefill_queue_s: Sequence[float]
    prefix_blocks: Sequence[int]
    decode_nodes: Sequence[Hashable] = ()
    decode_batch: Sequence[int] = ()
    decode_context_tokens: Sequence[float] = ()
    decode_free_kv_tokens: Sequence[float] = ()
    holder_nodes: Sequence[Hashable] = ()
    holder_prefix_blocks: Sequence[int] = ()
    prefill_queued_s: Sequence[QueuedWork | Sequence[float]] = ()
    prefill_busy_s: Sequence[float] = ()
    holder_busy_s: Sequence[float] = ()
    pending_prefix_blocks: Sequence[int] = ()
    pending_ready_s: Sequence[float] = ()
    prefill_free_s: Sequence[float] = ()
    path_bytes_per_s: Mapping[tuple[Hashable, Hashable], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, m = len(self.prefill_nodes), len(self.decode_nodes)
        if len(self.holder_nodes) != len(self.holder_prefix_blocks):
            raise ValueError("snapshot holder columns differ in length")
        if (len(self.prefill_queued_s) not in (0, n) or len(self.prefill_busy_s) not in (0, n)
                or len(self.prefill_free_s) not in (0, n)
                or len(self.holder_busy_s) not in (0, len(self.holder_nodes))
                or len(self.pending_prefix_blocks) not in (0, n)
                or len(self.pending_ready_s) != len(self.pending_prefix_blocks)):
            raise ValueError("snapshot optional columns differ in length from their nodes")
        if not (len(self.prefill_queue_s) == len(self.prefix_blocks) == n):
            raise ValueError("snapshot prefill columns differ in length")
        if not (len(self.decode_batch) == len(self.decode_context_tokens)
                == len(self.decode_free_kv_tokens) == m):
            raise ValueError("snapshot decode columns differ in length")


@dataclass(frozen=True)
class Fetch:
    """Blocks the prefill node pulls from another node before prefilling.

    `keys` are the request's keys [first_block, first_block + len(keys)); `source` holds
    them all; `tokens` their token count.
    """

    source: Hashable
    first_block: int
    keys: tuple
    tokens: int


@dataclass(frozen=True)
class Placement:
    """Where a request runs and what the conductor predicts for it (seconds, tokens)."""

    prefill: Hashable
    decode: Hashable | None
    prefix_blocks: int          # blocks reused (own + fetched)
    prefix_tokens: int          # tokens reused = min(prefix_blocks * block_size, prompt)
    local_prefix_blocks: int    # blocks the prefill node already held
    fetch: Fetch | None
    predicted_queue_s: float
    predicted_transfer_s: float
    predicted_prefill_s: float
    predicted_ttft_s: float
    predicted_tbt_s: float
    waits_for_pending: bool = False   # reuses blocks a prefill queued on its node will store
    # elastic pipeline (PolicyConfig.pipeline_stages): the other stages' nodes, in stage
    # order after `prefill` (stage 0, which stores the KV), and the pipeline's timing;
    # predicted_prefill_s is then its latency, and all stages start together
    # predicted_ttft_s - latency from now (predicted_queue_s: the wait for the last of
    # them to be free)
    helpers: tuple = ()
    pipeline: PipelineTiming | None = None


@dataclass(frozen=True)
class Rejection:
    """An early rejection (HTTP 429): `reason` is "ttft_slo", "tbt_slo", "decode_full" or
    "no_prefill_node"; `retry_after_s` when trying again is likely to be admitted."""

    reason: str
    retry_after_s: float
    predicted_ttft_s: float = math.nan
    predicted_tbt_s: float = math.nan


def place(req: PlacementRequest, snap: Snapshot, cost: CostModel, cfg: PolicyConfig,
          rng: _random.Random | None = None) -> Placement | Rejection:
    """Places one request (Mooncake Algorithm 1 and its baselines, see the module doc).

    Args:
        req: the request's block keys and lengths.
        snap: node state; prefix matches come from `PrefixIndex.match(req.keys, nodes)`.
        cost: prediction models.
        cfg: the policy and its thresholds.
        rng: source of randomness for the ``random`` policy (pure: same state, same pick).
    Returns: a Placement, or a Rejection when an SLO would break or no node can serve.
    Raises: ValueError for the ``random`` policy without `rng`, or a negative prompt length.
    Cost: O(prefill nodes + decode nodes); the prefill model is evaluated once per
    distinct prefix length (fetch_rule "cost": O(prefill nodes x distinct prefix lengths);
    prefill_order "spf": plus O(queued requests)); with measured paths into a prefill node
    (`Snapshot.path_bytes_per_s`) its fetch is priced per source: times O(sources).
    """
    n = req.prompt_tokens
    if n < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {n}")
    nodes = snap.prefill_nodes
    if not nodes:
        return Rejection("no_prefill_node", cfg.min_retry_after_s)
    bs = cfg.block_size
    queue, own = snap.prefill_queue_s, snap.prefix_blocks
    memo: dict[int, float] = {}

    def prefill_s(blocks: int) -> float:
        t = memo.get(blocks)
        if t is None:
            c = min(blocks * bs, n)
            t = memo[blocks] = cost.prefill_s(n - c, c)
        return t

    policy = cfg.policy
    fetch_from = None        # the source node when the choice fetches
    xfer = 0.0
    used = -1
    overlap = False          # the fetch runs while the request waits in the queue
    pending = False          # the prefix used is partly still being computed on the node
    if policy == "random":
        if rng is None:
            raise ValueError("the random policy needs an rng")
        i = rng.randrange(len(nodes))
    elif policy == "load_balancing":
        i = min(range(len(nodes)), key=queue.__getitem__)
    else:
        global_ = policy in ("global_cache_aware", "cost_aware")
        always = cfg.fetch_policy == "always"
        overtakes = None
        if cfg.prefill_order == "spf" and snap.prefill_queued_s:
            queue, overtakes = [], []
            for q, work, m in zip(snap.prefill_queue_s, snap.prefill_queued_s, own):
                if not isinstance(work, QueuedWork):
                    work = QueuedWork.of(work)
                before, over = work.ahead(prefill_s(m))
                queue.append(max(0.0, q - work.total_s()) + before)
                overtakes.append(over)
        if global_ and cfg.fetch_rule == "cost":
            i, used, xfer, fetch_from, ready = _cost_choice(n, bs, queue, own, snap, cost,
                                                            prefill_s, overtakes,
                                                            cfg.fetch_policy)
            overlap = True
            if ready is not None:            # waits for a prefix still being computed there
                pending, queue = True, list(queue)
                queue[i] = max(queue[i], ready)
        else:
            # A node's TTFT is queue + the prefill it would run. Which prefill (own prefix,
            # or fetch up to best_len) depends only on its own prefix length, not on its
            # queue: transfer + prefill(best) < prefill(own) is the same test on every node.
            # So decide once per distinct prefix length, then scan the nodes.
            # With measured paths (Snapshot.path_bytes_per_s) the transfer, and so the
            # test, also depends on the node's paths from the holders: such a node decides
            # for itself, from the holder of best_len it reaches soonest.
            fetching = global_ and cfg.fetch_policy != "never"
            holders = snap.holder_prefix_blocks if fetching else ()
            best = max(max(own), max(holders, default=0))
            thr = cfg.cache_balance_threshold
            into = _paths_into(snap) if fetching else {}
            # the nodes holding best_len, in Algorithm 1's order (it fetches from the first)
            cands = ([h for h, b in zip(snap.holder_nodes, holders) if b == best]
                     + [v for v, b in zip(nodes, own) if b == best]) if best > 0 else []

            def decide(mine: int, rates: dict | None) -> tuple[float, float, Hashable | None]:
                # (transfer + prefill s, transfer s, source) where fetching wins, else
                # (prefill s, 0, None)
                c = prefill_s(mine)
                if fetching and best > mine and (always or mine == 0 or best > thr * mine):
                    tokens = min(best * bs, n) - min(mine * bs, n)
                    if rates is None:
                        x, s = cost.transfer_s(tokens), cands[0]
                    else:                    # the holder reached soonest, the first on a tie
                        x, _, s = min((_transfer_s(cost, tokens, rates.get(h)), k, h)
                                      for k, h in enumerate(cands))
                    # fetching beats recomputing (or the fixed policy always fetches)
                    if always or x + prefill_s(best) < c:
                        return x + prefill_s(best), x, s
                return c, 0.0, None

            plans: dict[tuple[int, int], tuple[float, float, Hashable | None]] = {}
            plan_of = []                     # (own blocks, -1 or the node's index if it has paths)
            for k, m in enumerate(own):
                rates = into.get(nodes[k])
                key = (m, -1 if rates is None else k)
                if key not in plans:
                    plans[key] = decide(m, rates)
                plan_of.append(key)
            ttfts = [q + plans[key][0] for q, key in zip(queue, plan_of)]
            i = ttfts.index(min(ttfts))
            _, x, source = plans[plan_of[i]]
            if source is not None:
                xfer, used, fetch_from = x, best, source
    if used < 0:
        used = own[i]
    pf = prefill_s(used)
    wait = queue[i]
    ttft = (max(xfer, wait) if overlap else xfer + wait) + pf
    helpers, timing = (), None
    if cfg.pipeline_stages > 1 and snap.prefill_free_s and policy not in ("random",
                                                                        "load_balancing"):
        pc = _pipeline_choice(n, bs, own, snap, cost, cfg, ttft,
                              policy in ("global_cache_aware", "cost_aware")
                              and cfg.fetch_policy != "never")
        if pc is not None:
            i, used, xfer, fetch_from, helpers, timing, ttft, wait = pc
            pf, pending = timing.latency_s, False
    fetch = None
    if fetch_from is not None:
        lo = own[i]
        fetch = Fetch(source=fetch_from, first_block=lo, keys=tuple(req.keys[lo:used]),
                      tokens=min(used * bs, n) - min(lo * bs, n))

    decode, tbt = None, 0.0
    if snap.decode_nodes:
        j, tbt, room = choose_decode(n, req.max_new_tokens, snap, cost, cfg.decode_rule)
        decode = snap.decode_nodes[j]
        if not room and math.isfinite(cfg.tbt_slo_s):
            return Rejection("decode_full", cfg.min_retry_after_s, ttft, tbt)

    if ttft > cfg.ttft_slo_s:
        # The queue drains one second per second, so about (ttft - slo) from now it fits.
        return Rejection("ttft_slo", max(cfg.min_retry_after_s, ttft - cfg.ttft_slo_s), ttft, tbt)
    if tbt > cfg.tbt_slo_s:
        return Rejection("tbt_slo", cfg.min_retry_after_s, ttft, tbt)
    return Placement(prefill=nodes[i], decode=decode, prefix_blocks=used,
                     prefix_tokens=min(used * bs, n), local_prefix_blocks=own[i], fetch=fetch,
                     predicted_queue_s=wait, predicted_transfer_s=xfer,
                     predicted_prefill_s=pf, predicted_ttft_s=ttft, predicted_tbt_s=tbt,
                     waits_for_pending=pending, helpers=helpers, pipeline=timing)


class QueuedWork(NamedTuple):
    """The prefills waiting in one node's queue (the running one excluded), as a
    shortest-first queue sees them: predicted seconds sorted ascending, and their running
    sums (cumsum_s[k] = sum of sorted_s[:k + 1]). Build it with `QueuedWork.of`."""

    sorted_s: tuple[float, ...]
    cumsum_s: tuple[float, ...]

    @classmethod
    def of(cls, queued_s: Sequence[float]) -> QueuedWork:
        """From the predicted prefill seconds of the queued requests, in any order."""
        xs = tuple(sorted(queued_s))
        return cls(xs, tuple(itertools.accumulate(xs)))

    def total_s(self) -> float:
        """All queued prefill seconds."""
        return self.cumsum_s[-1] if self.cumsum_s else 0.0

    def ahead(self, prefill_s: float) -> tuple[float, int]:
        """(seconds of the queued prefills no longer than `prefill_s`, which run before a
        new request of that prefill; how many are longer, which it overtakes)."""
        k = bisect.bisect_right(self.sorted_s, prefill_s)
        return (self.cumsum_s[k - 1] if k else 0.0), len(self.sorted_s) - k


def spf_wait_s(queue_s: float, queued: QueuedWork | Sequence[float],
               prefill_s: float) -> float:
    """Predicted wait of a new request on a shortest-predicted-prefill-first queue, seconds.

    Args:
        queue_s: all predicted work on the node (running remainder + queued), seconds.
        queued: the queued (not running) requests' predicted prefill seconds, as a
            QueuedWork or a plain sequence.
        prefill_s: the new request's predicted prefill on this node, seconds.
    Returns: the running remainder plus the queued prefills no longer than the new one
        (they run first; a tie keeps arrival order). Requests aging past the starvation
        bound may also go first; that is not predicted (it only lengthens waits under
        overload, where rejection on the TTFT SLO takes over).
    """
    if not isinstance(queued, QueuedWork):
        queued = QueuedWork.of(queued)
    before, _ = queued.ahead(prefill_s)
    return max(0.0, queue_s - queued.total_s()) + before


def spf_bound_s(aging_s: float, fcfs_wait_s: float, fcfs_slack_s: float,
                fcfs_slack_ratio: float = math.inf) -> float:
    """A request's starvation bound on a shortest-first queue, seconds of waiting after
    which it goes first (`spf_pick`): aging_s, or sooner the wait FCFS would have given it
    (the predicted work ahead of it when it was enqueued) plus its slack.

    The slack is fcfs_slack_s, and at most fcfs_slack_ratio x fcfs_wait_s (inf: no such
    cap): with ratio 1 a request never waits more than twice its FCFS wait, so the bound
    follows the load, tight where the node is lightly queued (FCFS would start it soon)
    and up to fcfs_slack_s where FCFS itself would keep it waiting
    (PolicyConfig.fcfs_slack_ratio). Raises nothing; all arguments in seconds except the
    ratio.
    """
    slack = fcfs_slack_s
    if math.isfinite(fcfs_slack_ratio):
        slack = min(slack, fcfs_slack_ratio * fcfs_wait_s)
    return min(aging_s, fcfs_wait_s + slack)


def spf_pick(waiting: Sequence[tuple[float, ...]], now: float, aging_s: float,
             bound_on_start: bool = False) -> int:
    """Which queued request a shortest-first prefill queue runs next.

    Args:
        waiting: (enqueued at, predicted prefill s) or (enqueued at, predicted prefill s,
            its own starvation bound s, `spf_bound_s`) of each request ready to run, in
            arrival order (seconds on any one clock).
        now: the current time on that clock.
        aging_s: the starvation bound of entries without their own.
        bound_on_start: False: a request goes first once it has waited its bound (a
            prefill started just before may still make it start later, by up to that
            prefill's length). True (PolicyConfig.spf_bound_rule "start"): the bound is on
            the start time: the shortest prefill runs only if it is predicted to end
            before every waiting request's bound runs out; otherwise the oldest of those
            it would push past their bound goes first.
    Returns: the index in `waiting`: the oldest request that has waited its bound or more
        (or, with bound_on_start, would have by the end of the shortest prefill), else
        the shortest predicted prefill (the earliest among equals).
    Raises: ValueError when `waiting` is empty.
    """
    if not waiting:
        raise ValueError("nothing to pick from")
    best, key = 0, math.inf
    for k, w in enumerate(waiting):
        if now - w[0] >= (w[2] if len(w) > 2 else aging_s):
            return k                     # arrival order: the first aged one is the oldest
        if w[1] < key:
            best, key = k, w[1]
    if bound_on_start:
        end = now + key                  # when the shortest would end
        for k, w in enumerate(waiting):
            if k != best and end - w[0] > (w[2] if len(w) > 2 else aging_s):
                return k                 # it would start past its bound: it goes first
    return best


def _cost_choice(n: int, bs: int, waits: Sequence[float], own: Sequence[int], snap: Snapshot,
                 cost: CostModel, prefill_s, overtakes: Sequence[int] | None = None,
                 fetch_policy: str = "adaptive"
                 ) -> tuple[int, int, float, Hashable | None, float | None]:
    """Fetch or recompute by predicted time (fetch_rule "cost"), for every prefill node.

    For each prefix length L held by some node (a holder of L blocks holds every shorter
    prefix too), the source is the least busy node holding at least L (a cache node before
    a prefill node when equally busy: it spares compute). Node i with own prefix m and wait
    w either recomputes, TTFT = w + prefill(m), or fetches the blocks m..L while it waits,
    TTFT = max(w, busy(source) + transfer(L - m)) + prefill(L). No ratio threshold.
    With measured paths into node i (`snap.path_bytes_per_s`), transfer(source -> i) runs
    at each path's rate (unmeasured ones at the cost model's) and node i's source is the
    holder of at least L with the lowest busy + transfer (`_fetch_source`): the source
    may differ per node. Without, every node's source is the least busy holder.
    With `overtakes` (shortest-first queues: how many queued requests on each node the
    new one would run before), each overtaken request waits the new one's prefill longer,
    so a node scores TTFT + overtaken x prefill: the total delay the placement causes.
    That keeps short requests off a node whose long queued request they would starve.
    With `snap.pending_prefix_blocks`, node i may also wait for the prefix a prefill
    queued there will store: TTFT = max(w, pending_ready_s) + prefill(pending blocks).
    `fetch_policy` (PolicyConfig's): "always": a node lacking the longest prefix held
    anywhere fetches it, whatever the prediction (scored at that choice); "never": no
    fetch is considered (own and pending prefixes only).
    Returns: (node index, blocks used, fetch seconds incl. the source's busy time, source
    node or None, pending ready seconds when the choice waits for a pending prefix else
    None); the node with the lowest score wins (the first among equals).
    """
    lengths, src, every = (_prefix_sources(own, snap) if fetch_policy != "never"
                           else ([], {}, []))
    into = _paths_into(snap) if lengths else {}
    always = fetch_policy == "always"
    tokens = [min(L * bs, n) for L in lengths]
    best_t, best = math.inf, (0, own[0] if own else 0, 0.0, None, None)
    pend, pend_s = snap.pending_prefix_blocks, snap.pending_ready_s
    plan: dict[tuple[int, int], float] = {}          # (own m, L) -> fetch seconds
    for i, (w, m) in enumerate(zip(waits, own)):
        over = overtakes[i] if overtakes else 0
        t = w + prefill_s(m) * (1 + over)
        choice = None
        mt = min(m * bs, n)
        rates = into.get(snap.prefill_nodes[i])      # measured paths into node i
        for L, tok in zip(lengths, tokens):
            if L <= m or tok <= mt:
                break
            if rates is None:            # every path at the cost model's rate
                s = src[L]
                x = plan.get((m, L))
                if x is None:
                    x = plan[(m, L)] = s[0] + cost.transfer_s(tok - mt)
            else:
                x, s = _fetch_source(every, L, tok - mt, rates, cost, snap)
            tt = max(w, x) + prefill_s(L) * (1 + over)
            if always:                   # the longest prefix, fetched whatever it costs
                t, choice = tt, (L, x, s)
                break
            if tt < t:
                t, choice = tt, (L, x, s)
        if pend and pend[i] > m and not always:
            tt = max(w, pend_s[i]) + prefill_s(pend[i]) * (1 + over)
            if tt < t:
                t, choice = tt, (pend[i], None, None)
        if t < best_t:
            if choice is None:
                best_t, best = t, (i, m, 0.0, None, None)
            elif choice[1] is None:
                best_t, best = t, (i, choice[0], 0.0, None, pend_s[i])
            else:
                L, x, s = choice
                best_t, best = t, (i, L, x, _source_node(s, snap), None)
    return best


def _prefix_sources(own: Sequence[int], snap: Snapshot
                    ) -> tuple[list[int], dict[int, tuple[float, int, int]],
                               list[tuple[int, tuple[float, int, int]]]]:
    """The prefix lengths (blocks) held anywhere, longest first; for each length L the
    least busy node holding at least L as (busy s, 0 cache node / 1 prefill node, index),
    a cache node before an equally busy prefill node (it spares compute); and every node
    holding a prefix as (its blocks, (busy s, kind, index)), for `_fetch_source`."""
    pbusy = snap.prefill_busy_s or [0.0] * len(own)
    hbusy = snap.holder_busy_s or [0.0] * len(snap.holder_nodes)
    by_len: dict[int, tuple[float, int, int]] = {}   # L -> (busy, 0 cache / 1 prefill, index)
    every: list[tuple[int, tuple[float, int, int]]] = []
    for k, (L, b) in enumerate(zip(snap.holder_prefix_blocks, hbusy)):
        if L > 0:
            every.append((L, (b, 0, k)))
        if L > 0 and (L not in by_len or (b, 0, k) < by_len[L]):
            by_len[L] = (b, 0, k)
    for k, (L, b) in enumerate(zip(own, pbusy)):
        if L > 0:
            every.append((L, (b, 1, k)))
        if L > 0 and (L not in by_len or (b, 1, k) < by_len[L]):
            by_len[L] = (b, 1, k)
    lengths = sorted(by_len, reverse=True)
    src: dict[int, tuple[float, int, int]] = {}      # L -> least busy source holding >= L
    run = None
    for L in lengths:
        if run is None or by_len[L] < run:
            run = by_len[L]
        src[L] = run
    return lengths, src, every


def _paths_into(snap: Snapshot) -> dict[Hashable, dict[Hashable, float]]:
    """`snap.path_bytes_per_s` as destination -> {source: bytes/s}, the usable rates only
    (finite and > 0; any other counts as not measured)."""
    into: dict[Hashable, dict[Hashable, float]] = {}
    for (s, d), r in snap.path_bytes_per_s.items():
        if r > 0 and math.isfinite(r):
            into.setdefault(d, {})[s] = r
    return into


def _transfer_s(cost: CostModel, tokens: float, rate: float | None) -> float:
    """Predicted seconds to move the KV of `tokens` tokens over a path delivering `rate`
    bytes/s: the cost model's latency + bytes / rate, as `TransferModel.seconds` (0 for
    nothing to move); `rate` None: the cost model's own rate (`cost.transfer_s`)."""
    if rate is None:
        return cost.transfer_s(tokens)
    nbytes = tokens * cost.kv_bytes_per_token
    return cost.transfer.latency_s + nbytes / rate if nbytes > 0 else 0.0


def _fetch_source(every: Sequence[tuple[int, tuple[float, int, int]]], blocks: int,
                  tokens: float, rates: Mapping[Hashable, float], cost: CostModel,
                  snap: Snapshot) -> tuple[float, tuple[float, int, int]]:
    """The source a node fetches `tokens` tokens of a `blocks`-block prefix from, given
    the measured rates of its paths from the sources (`rates`: source node -> bytes/s;
    a path not in it runs at the cost model's rate): among the nodes of `every`
    (`_prefix_sources`) holding at least `blocks`, the lowest busy + transfer seconds,
    then the least busy, a cache node before a prefill node, the lower index (with every
    path at one rate that is `_prefix_sources`' least busy holder).
    Returns: (busy + transfer seconds, (busy s, kind, index) of the source).
    Raises: ValueError when no node holds `blocks`."""
    return min((s[0] + _transfer_s(cost, tokens, rates.get(_source_node(s, snap))), s)
               for L, s in every if L >= blocks)


def _source_node(s: tuple[float, int, int], snap: Snapshot) -> Hashable:
    _, kind, k = s
    return snap.holder_nodes[k] if kind == 0 else snap.prefill_nodes[k]


def _pipeline_choice(n: int, bs: int, own: Sequence[int], snap: Snapshot, cost: CostModel,
                     cfg: PolicyConfig, single_ttft_s: float, can_fetch: bool):
    """Elastic chunked pipeline parallelism (paper section 3.3, chosen per request): run the
    request over k = 2..cfg.pipeline_stages prefill nodes with nothing queued, when that is
    predicted to give a lower TTFT than `single_ttft_s` (the best single-node choice).

    Stage 0 (the primary, which stores the request's blocks as a single node would) is any
    node with nothing queued, reusing its own prefix or, when `can_fetch`, fetching a longer
    one held elsewhere (from the least busy holder; with measured paths into the primary,
    `Snapshot.path_bytes_per_s`, the holder with the lowest busy + transfer over its path,
    `_fetch_source`). The other stages are the k - 1 other such nodes free soonest
    (`Snapshot.prefill_free_s`); they hold their slice of the layers of the reused prefix
    only after copying it, (k - 1) / k of its KV bytes (at the cost model's rate).
    With step = (latency - occupancy) / (k - 1) (the longest chunk's stage time plus a
    hop), stage j joins j steps after stage 0 starts, when its first chunk arrives, and
    is busy for the occupancy; so it may still finish other work until then. The
    pipeline starts at t0 = max(stage 0 free, stage j free - j x step, fetch,
    transfer((k - 1) / k x prefix)); TTFT = t0 + latency, with latency and occupancy
    from `cpp_cost.pipeline_timing` on chunks of cfg.pipeline_chunk_tokens. Only
    requests with at least cfg.pipeline_min_tokens uncached tokens qualify.
    The stages' compute adds up to the single prefill's, but a stage free before it is
    needed sits idle (reserved). Under load those node-seconds delay other requests, so
    a candidate scores TTFT + that idle time x the number of prefill nodes with requests
    queued (none queued: the idle time costs nobody), against the single node's TTFT;
    the lowest score wins (the fewest stages among equals). Under load (a node queued) the
    winner is taken only when `pipeline_rescues` (cfg.pipeline_under_load_ttft_s).
    Returns: None when no pipeline is predicted faster, else (primary index, blocks used,
        fetch seconds, fetch source or None, helper node ids in stage order,
        PipelineTiming, TTFT s, seconds until stage 0 starts).
    """
    free = snap.prefill_free_s
    cand = sorted((f, k) for k, f in enumerate(free) if math.isfinite(f))
    kmax = min(cfg.pipeline_stages, len(cand))
    if kmax < 2:
        return None
    lengths, src, every = _prefix_sources(own, snap) if can_fetch else ([], {}, [])
    into = _paths_into(snap) if lengths else {}
    memo: dict[tuple[int, int], PipelineTiming] = {}
    queued = sum(1 for f in free if f == math.inf)   # nodes with requests waiting
    slo = cfg.pipeline_under_load_ttft_s
    if queued and slo > 0 and not single_ttft_s > slo:
        return None   # under load only a request that misses on one node may pipeline
    best_t, best = single_ttft_s, None
    best_score = single_ttft_s
    for fi, i in cand:
        # free times of the helpers, soonest first
        others = [f for f, h in cand[:kmax] if h != i][:kmax - 1]
        m = own[i]
        mt = min(m * bs, n)
        opts = [(m, 0.0, None)]
        rates = into.get(snap.prefill_nodes[i])      # measured paths into node i
        for L in lengths:
            tok = min(L * bs, n) - mt
            if L > m and tok > 0:
                opts.append((L, src[L][0] + cost.transfer_s(tok), src[L]) if rates is None
                            else (L, *_fetch_source(every, L, tok, rates, cost, snap)))
        for L, x, s in opts:
            c = min(L * bs, n)
            if n - c < max(1, cfg.pipeline_min_tokens):
                continue
            for k in range(2, kmax + 1):
                tm = memo.get((c, k))
                if tm is None:
                    tm = memo[(c, k)] = pipeline_timing(cost, n - c, c, k,
                                                        cfg.pipeline_chunk_tokens,
                                                        cfg.pipeline_hidden_bytes_per_token)
                # stage j joins j steps after stage 0 starts (its first chunk arrives
                # then) and stays busy for the occupancy: it may finish other work first
                step = (tm.latency_s - tm.occupancy_s) / (k - 1)
                hs = others[:k - 1]
                t0 = max(fi, x, cost.transfer_s(c * (k - 1) / k),
                         max(f - j * step for j, f in enumerate(hs, 1)))
                t = t0 + tm.latency_s
                # node-seconds the stages sit idle, waiting for the pipeline to start
                waste = (t0 - fi) + sum(t0 + j * step - f for j, f in enumerate(hs, 1))
                score = t + waste * queued
                if score < best_score:
                    best_score, best_t, best = score, t, (i, L, x, s, k, tm, t0)
    if best is None or not pipeline_rescues(queued, single_ttft_s, best_t, slo):
        return None
    i, L, x, s, k, tm, w = best
    helpers = tuple(snap.prefill_nodes[h] for _, h in cand if h != i)[:k - 1]
    return (i, L, x, (_source_node(s, snap) if s is not None else None), helpers, tm, best_t,
            w)


def pipeline_rescues(queued_nodes: int, single_ttft_s: float, pipeline_ttft_s: float,
                     under_load_ttft_s: float) -> bool:
    """Whether an elastic pipeline may be taken, given its predicted TTFT against the best
    single node's (pure). With no prefill node queued (`queued_nodes` 0), or with
    `under_load_ttft_s` 0 (the rule off), always. Under load the helper's node time is
    taken from queued requests, which under shortest-first queues are mostly short ones;
    so only a pipeline that turns a TTFT miss into a hit pays for it: single_ttft_s >
    under_load_ttft_s >= pipeline_ttft_s (inf: never under load).
    """
    if not queued_nodes or under_load_ttft_s == 0:
        return True
    return single_ttft_s > under_load_ttft_s >= pipeline_ttft_s


def choose_decode(prompt_tokens: int, max_new_tokens: int, snap: Snapshot, cost: CostModel,
                  rule: str = "step") -> tuple[int, float, bool]:
    """The decode node for a request (the conductor-side decision; pure).

    Args:
        prompt_tokens, max_new_tokens: the request's KV need = their sum, tokens.
        snap: the decode columns (batch, context tokens, free KV tokens per node).
        cost: the decode step model.
        rule: "step": the lowest predicted step time at (batch + 1, context + prompt) among
            nodes with KV room for the need (Algorithm 1's load-based choice).
            "kv_aware": the lowest predicted step time after admission at the context the
            request will have grown to (context + prompt + output), among nodes that keep
            room for another request of the same need after admitting this one; else among
            nodes with room; so it spreads KV before a node fills and a later request finds
            no room.
    Returns: (index into snap.decode_nodes, predicted TBT seconds = the step time at
        (batch + 1, context + prompt) on that node, whether it has room); with no node with
        room, the one with the most free KV and room False.
    Raises: ValueError on an empty decode side or an unknown rule.
    """
    if not snap.decode_nodes:
        raise ValueError("no decode nodes")
    n, need = prompt_tokens, prompt_tokens + max_new_tokens
    step = cost.decode
    free, batch, ctx = snap.decode_free_kv_tokens, snap.decode_batch, snap.decode_context_tokens
    if rule == "step":
        scores = [step(b + 1, c + n) if f >= need else math.inf
                  for b, c, f in zip(batch, ctx, free)]
    elif rule == "kv_aware":
        scores = [step(b + 1, c + need) if f >= 2 * need else math.inf
                  for b, c, f in zip(batch, ctx, free)]
        if min(scores) == math.inf:
            scores = [step(b + 1, c + need) if f >= need else math.inf
                      for b, c, f in zip(batch, ctx, free)]
    else:
        raise ValueError(f"unknown decode rule {rule!r}; choose one of {', '.join(DECODE_RULES)}")
    best = min(scores)
    room = best < math.inf
    j = scores.index(best) if room else max(range(len(free)), key=free.__getitem__)
    return j, cost.decode_step_s(batch[j] + 1, ctx[j] + n), room
