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
  more nodes (section 4.2).

For every policy the decode node is the one with the lowest predicted step time
(batch + 1, context + prompt) among those with KV room, and the request is
rejected early (HTTP 429 with Retry-After) when the predicted TTFT or TBT breaks
its SLO (section 4, step 4; section 7 on overload).
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .cost_model import CostModel

POLICIES = ("random", "load_balancing", "local_cache_aware", "global_cache_aware")


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
    Raises (constructor): ValueError on an unknown policy or out-of-range value.
    """

    policy: str = "global_cache_aware"
    block_size: int = 512
    cache_balance_threshold: float = 1.5
    ttft_slo_s: float = math.inf
    tbt_slo_s: float = math.inf
    min_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown placement policy {self.policy!r}; choose one of "
                             f"{', '.join(POLICIES)}")
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

    def __post_init__(self) -> None:
        n, m = len(self.prefill_nodes), len(self.decode_nodes)
        if len(self.holder_nodes) != len(self.holder_prefix_blocks):
            raise ValueError("snapshot holder columns differ in length")
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
    distinct prefix length.
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
    if policy == "random":
        if rng is None:
            raise ValueError("the random policy needs an rng")
        i = rng.randrange(len(nodes))
    elif policy == "load_balancing":
        i = min(range(len(nodes)), key=queue.__getitem__)
    else:
        # A node's TTFT is queue + the prefill it would run. Which prefill (own prefix, or
        # fetch up to best_len) depends only on its own prefix length, not on its queue:
        # transfer + prefill(best) < prefill(own) is the same test on every node. So decide
        # once per distinct prefix length, then scan the nodes with plain list operations.
        holders = snap.holder_prefix_blocks if policy == "global_cache_aware" else ()
        best = max(max(own), max(holders, default=0))
        thr = cfg.cache_balance_threshold
        fetches: dict[int, float] = {}   # own blocks -> transfer s, where fetching wins
        cost_of: dict[int, float] = {}   # own blocks -> transfer + prefill s
        for mine in set(own):
            cost_of[mine] = prefill_s(mine)
            if (policy == "global_cache_aware" and best > mine
                    and (mine == 0 or best > thr * mine)):
                x = cost.transfer_s(min(best * bs, n) - min(mine * bs, n))
                if x + prefill_s(best) < cost_of[mine]:     # fetching beats recomputing
                    cost_of[mine] = x + prefill_s(best)
                    fetches[mine] = x
        ttfts = [q + cost_of[m] for q, m in zip(queue, own)]
        i = ttfts.index(min(ttfts))
        if own[i] in fetches:
            xfer, used = fetches[own[i]], best
            fetch_from = (snap.holder_nodes[list(holders).index(best)] if best in holders
                          else nodes[own.index(best)])
    if used < 0:
        used = own[i]
    pf = prefill_s(used)
    ttft = xfer + queue[i] + pf
    fetch = None
    if fetch_from is not None:
        lo = own[i]
        fetch = Fetch(source=fetch_from, first_block=lo, keys=tuple(req.keys[lo:used]),
                      tokens=min(used * bs, n) - min(lo * bs, n))

    # Decode: lowest predicted step time among nodes with KV room for prompt + output;
    # when none has room, the one with the most room.
    decode, tbt = None, 0.0
    if snap.decode_nodes:
        need = n + req.max_new_tokens
        step = cost.decode
        free = snap.decode_free_kv_tokens
        steps = [step(b + 1, c + n) if f >= need else math.inf
                 for b, c, f in zip(snap.decode_batch, snap.decode_context_tokens, free)]
        best_step = min(steps)
        room = best_step < math.inf
        j = steps.index(best_step) if room else max(range(len(free)), key=free.__getitem__)
        decode = snap.decode_nodes[j]
        tbt = cost.decode_step_s(snap.decode_batch[j] + 1, snap.decode_context_tokens[j] + n)
        if not room and math.isfinite(cfg.tbt_slo_s):
            return Rejection("decode_full", cfg.min_retry_after_s, ttft, tbt)

    if ttft > cfg.ttft_slo_s:
        # The queue drains one second per second, so about (ttft - slo) from now it fits.
        return Rejection("ttft_slo", max(cfg.min_retry_after_s, ttft - cfg.ttft_slo_s), ttft, tbt)
    if tbt > cfg.tbt_slo_s:
        return Rejection("tbt_slo", cfg.min_retry_after_s, ttft, tbt)
    return Placement(prefill=nodes[i], decode=decode, prefix_blocks=used,
                     prefix_tokens=min(used * bs, n), local_prefix_blocks=own[i], fetch=fetch,
                     predicted_queue_s=queue[i], predicted_transfer_s=xfer,
                     predicted_prefill_s=pf, predicted_ttft_s=ttft, predicted_tbt_s=tbt)
