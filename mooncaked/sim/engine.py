"""Discrete-event simulator of a Mooncake cluster (or of coupled vLLM-like instances).

Replays a Mooncake-format trace through N prefill and M decode instances with the
conductor's own placement function (`mooncaked.conductor.policy.place`), global
prefix index (`PrefixIndex`) and cost models (`CostModel`):

- Prefill instance: a FIFO queue (or shortest predicted prefill first with an aging
  bound, prefill_order "spf", `policy.spf_pick`), one request at a time (prefill time from the cost
  model with the prefix it actually holds when it starts), an LRU cache of KV blocks
  of `cache_tokens` tokens (its DRAM pool). Blocks the placement fetches from another
  node arrive after the predicted transfer time and become replicas (section 4.2).
  After a prefill, every block of the prompt is stored; store and eviction events feed
  the global index, as the live store's events do.
- The prompt's KV streams to the decode instance layer by layer while the prefill
  runs: it lands at max(prefill end, prefill start + transfer(prompt)).
- Decode instance: continuous batching. A request joins at the next step boundary once
  its KV landed and its prompt + output fits in `decode_kv_tokens`. The batch runs in
  segments of constant membership; a segment's step times come from the decode model
  at (batch size, context growing by one token per request per step), vectorized.
- ``coupled`` (the paper's vLLM baseline): N + M instances that prefill and decode.
  Waiting prompts run first (whole prompt, one at a time) and stall the instance's
  running decodes meanwhile; each instance caches prefixes locally; requests go to
  the instance with the least queued prefill work.

All times are simulated seconds; nothing reads the clock except the wall-time report.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from mooncaked.conductor.cost_model import CostModel, PaperSetting, paper_cost_model
from mooncaked.conductor.cpp_cost import PipelinedCostModel
from mooncaked.conductor.index import PrefixIndex
from mooncaked.conductor.policy import (
    POLICIES,
    PlacementRequest,
    PolicyConfig,
    QueuedWork,
    Rejection,
    Snapshot,
    place,
    spf_bound_s,
    spf_pick,
)
from mooncaked.measures import (
    cache_hit_rate,
    effective_request_capacity,
    percentile,
    tbt_s,
)

from .cache import LRUCache
from .trace import TRACE_BLOCK_TOKENS, TraceRequest

SIM_POLICIES = POLICIES + ("coupled",)
_MAX_SEG_STEPS = 4096   # longest precomputed decode segment; a longer one just continues

# event kinds
(_ARRIVE, _FETCH_DONE, _PF_START, _PF_DONE, _KV_READY, _SEG_END, _CP_DONE, _STAGE_FREE,
 _RESERVE_END) = range(9)


@dataclass
class SimConfig:
    """One simulation's cluster and knobs (times in seconds, sizes in tokens).

    `prefill`/`decode`: instance counts (``coupled`` runs prefill + decode coupled
    instances). `cache_tokens`: each prefill instance's block cache (math.inf:
    unbounded). `time_scale` multiplies every arrival time (0.5 = twice the rate).
    `decode_kv_tokens`: KV room of one decode (or coupled) instance; default the paper
    setting's (LLaMA3-70B bf16 on 8 x 80 GB). `output_tokens`: overrides every
    request's output length (1 = prefill only, as the paper's Figure 10).
    `ttft_slo_s`/`tbt_slo_s`: early rejection (inf: off). `ttft_threshold_s` and
    `tbt_thresholds_s`: what effective request capacity counts as served in time.
    `fetch_rule`, `decode_rule`, `prefill_order`, `aging_s`: the PolicyConfig options
    ("" or None = the policy's default; `policy.policy_defaults`); prefill_order also sets how
    the simulated prefill queues run.
    `cpp` > 1: the prefill instances form pipeline groups of `cpp` nodes (section 3.3),
    each group one placement target with `cpp` x the block cache, prefilling in chunks of
    `cpp_chunk_tokens` (conductor/cpp_cost.py; hidden states of
    `cpp_hidden_bytes_per_token` cross each stage boundary).
    `fcfs_slack_s`: spf's adaptive starvation bound (PolicyConfig.fcfs_slack_s; None: the
    policy's default); `fcfs_slack_ratio` caps that slack at this times the request's FCFS
    wait (PolicyConfig.fcfs_slack_ratio; None: the policy's default); `spf_bound_rule`
    "wait" or "start" (PolicyConfig.spf_bound_rule; "": the policy's default).
    `pipeline_stages`: elastic pipelines instead (PolicyConfig.pipeline_stages; 0 = the
    policy's default, 1 = off): the placement may run one request over up to this many
    prefill nodes with nothing queued, all starting when the last is free, in chunks of
    `cpp_chunk_tokens`; the first stage stores the KV and is free after the pipeline's
    occupancy, stage j after occupancy + j x (the longest chunk's stage time + one hop).
    `pipeline_under_load_ttft_s`: PolicyConfig.pipeline_under_load_ttft_s (while a prefill
    node has requests queued, pipeline only a request that misses this TTFT on one node
    and meets it pipelined; 0: off).
    """

    policy: str = "global_cache_aware"
    prefill: int = 10
    decode: int = 6
    cache_tokens: float = math.inf
    time_scale: float = 1.0
    block_tokens: int = TRACE_BLOCK_TOKENS
    decode_kv_tokens: float = field(default_factory=lambda: PaperSetting().decode_kv_capacity_tokens)
    max_batch: int = 256
    cache_balance_threshold: float = 1.5
    ttft_slo_s: float = math.inf
    tbt_slo_s: float = math.inf
    ttft_threshold_s: float = 30.0
    tbt_thresholds_s: tuple[float, ...] = (0.1, 0.2, 0.3)
    output_tokens: int | None = None
    seed: int = 0
    replica_ranks: tuple[int, ...] = (10, 100, 1000, 10000)
    replica_samples: int = 60
    hit_windows: int = 30
    fetch_rule: str = ""
    decode_rule: str = ""
    prefill_order: str = ""
    aging_s: float | None = None
    cpp: int = 1
    cpp_chunk_tokens: int = 4096
    cpp_hidden_bytes_per_token: int = 16384  # LLaMA3-70B: d_model 8192 x bf16
    pipeline_stages: int = 0
    fcfs_slack_s: float | None = None
    pipeline_under_load_ttft_s: float = 30.0
    fcfs_slack_ratio: float | None = None
    spf_bound_rule: str = ""

    def __post_init__(self) -> None:
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(SIM_POLICIES)}")
        if self.prefill < 1 or self.decode < 0:
            raise ValueError("need at least one prefill instance and zero or more decode instances")
        if self.decode == 0 and self.policy != "coupled" and self.output_tokens != 1:
            raise ValueError("decode = 0 needs output_tokens = 1 (prefill only) or the coupled policy")
        if not (self.time_scale > 0 and self.cache_tokens >= 0 and self.decode_kv_tokens > 0
                and self.max_batch >= 1):
            raise ValueError("time_scale, decode_kv_tokens and max_batch must be > 0, cache_tokens >= 0")
        if self.cpp < 1 or self.prefill % self.cpp or self.cpp_chunk_tokens < 1:
            raise ValueError(f"cpp must divide prefill ({self.prefill}) and chunk tokens be >= 1")
        if self.cpp > 1 and self.policy == "coupled":
            raise ValueError("cpp groups are prefill instances; the coupled baseline has none")
        if self.pipeline_stages < 0 or (self.cpp > 1 and self.pipeline_stages > 1):
            raise ValueError("pipeline_stages must be >= 0, and elastic pipelines (> 1) "
                             "exclude fixed cpp groups")


@dataclass
class SimResult:
    """A run's summary (JSON-ready) and per-request arrays for plots.

    `ttft_s`, `tbt_s`: one entry per completed request (seconds). `replicas`: rank ->
    list of (simulated seconds, number of prefill nodes holding the key of that
    popularity rank), the paper's Figure 11.
    """

    summary: dict
    ttft_s: np.ndarray
    tbt_s: np.ndarray
    replicas: dict[int, list[tuple[float, int]]]
    hit_windows: list[tuple[float, float]] = field(default_factory=list)


class _Req:
    __slots__ = ("i", "arrival", "n", "out", "keys", "first", "cached", "need", "remaining",
                 "segs", "done", "decode", "pf_start", "pf_end", "bound")

    def __init__(self, i: int, r: TraceRequest, arrival: float, out: int):
        self.i, self.arrival, self.n, self.out, self.keys = i, arrival, r.input_tokens, out, r.keys
        self.first = math.nan
        self.cached = 0
        self.need = r.input_tokens + out
        self.remaining = out - 1          # decode steps after the first token
        self.segs: list = []              # (cumulative step end times, steps used)
        self.done = math.nan
        self.decode = -1
        self.pf_start = 0.0
        self.pf_end = math.nan            # an elastic pipeline's predicted end
        self.bound = math.inf             # spf: seconds of waiting after which it goes first


class _PNode:
    """A prefill instance (disaggregated mode)."""

    __slots__ = ("idx", "cache", "queue", "queued_pred", "busy_until", "running", "waiting_fetch",
                 "_work", "pending", "reserved_until")

    def __init__(self, idx: int, cache_tokens: float, block_tokens: int):
        self.idx = idx
        self.cache = LRUCache(cache_tokens, block_tokens)
        self.queue: deque = deque()       # (req, fetch ready time, predicted s, runs after req)
        self.pending: dict = {}           # key -> the queued/running request that will store it
        self.queued_pred = 0.0
        self.busy_until = 0.0
        self.running: _Req | None = None
        self.waiting_fetch = False
        self._work: QueuedWork | None = None
        self.reserved_until = 0.0         # an elastic pipeline holds the node until then

    def work(self) -> QueuedWork:
        """The queue as a QueuedWork, rebuilt only after the queue changed."""
        if self._work is None:
            self._work = QueuedWork.of([x[2] for x in self.queue])
        return self._work


class _DNode:
    """A decode instance, or a coupled instance when `pq` is used."""

    __slots__ = ("idx", "batch", "waiting", "used", "ctx", "seg", "seg_n", "version",
                 "pending_n", "pending_ctx", "committed", "pq", "pq_pred", "prefilling",
                 "pf_until", "cache")

    def __init__(self, idx: int):
        self.idx = idx
        self.batch: list[_Req] = []
        self.waiting: deque[_Req] = deque()   # KV landed, waiting for room
        self.used = 0                         # KV tokens reserved by the batch (prompt + output)
        self.ctx = 0                          # context tokens of the batch at segment start
        self.seg = None                       # cumulative step end times of the running segment
        self.seg_n = 0
        self.version = 0
        self.pending_n = 0                    # placed here, not yet in the batch
        self.pending_ctx = 0
        self.committed = 0                    # KV tokens promised to placed requests
        self.pq: deque = deque()              # coupled: prompts waiting for prefill
        self.pq_pred = 0.0
        self.prefilling: _Req | None = None
        self.pf_until = 0.0
        self.cache: LRUCache | None = None


class Simulator:
    """Runs one trace through one cluster configuration; see `simulate`."""

    def __init__(self, trace: Sequence[TraceRequest], cfg: SimConfig, cost: CostModel | None = None):
        self.trace, self.cfg = trace, cfg
        self.cost = cost or paper_cost_model()
        self.base_cost = self.cost
        if cfg.cpp > 1:  # placement and prefill timing see each group's pipelined latency
            self.cost = PipelinedCostModel.of(self.cost, cfg.cpp, cfg.cpp_chunk_tokens,
                                              cfg.cpp_hidden_bytes_per_token)
        self.coupled = cfg.policy == "coupled"
        self.pcfg = PolicyConfig(policy="load_balancing" if self.coupled else cfg.policy,
                                 block_size=cfg.block_tokens,
                                 cache_balance_threshold=cfg.cache_balance_threshold,
                                 ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                                 fetch_rule=cfg.fetch_rule, decode_rule=cfg.decode_rule,
                                 prefill_order=cfg.prefill_order, aging_s=cfg.aging_s,
                                 fcfs_slack_s=cfg.fcfs_slack_s,
                                 pipeline_stages=1 if cfg.cpp > 1 or self.coupled
                                 else cfg.pipeline_stages,
                                 pipeline_chunk_tokens=cfg.cpp_chunk_tokens,
                                 pipeline_hidden_bytes_per_token=cfg.cpp_hidden_bytes_per_token,
                                 pipeline_under_load_ttft_s=cfg.pipeline_under_load_ttft_s,
                                 fcfs_slack_ratio=cfg.fcfs_slack_ratio,
                                 spf_bound_rule=cfg.spf_bound_rule)
        self.elastic = self.pcfg.pipeline_stages > 1
        self.pipelined = 0
        self.spf = self.pcfg.prefill_order == "spf" and not self.coupled
        self.bound_on_start = self.pcfg.spf_bound_rule == "start"
        # the cost rule may wait for a prefix a queued prefill will store (Snapshot.pending_*)
        self.track_pending = (self.pcfg.fetch_rule == "cost" and not self.coupled
                              and cfg.policy in ("global_cache_aware", "cost_aware"))
        self.rng = random.Random(cfg.seed)
        self.events: list = []
        self.seq = 0
        self.index = PrefixIndex()
        if self.coupled:
            self.dnodes = [_DNode(i) for i in range(cfg.prefill + cfg.decode)]
            for d in self.dnodes:
                d.cache = LRUCache(cfg.cache_tokens, cfg.block_tokens)
            self.pnodes: list[_PNode] = []
            self.pids = list(range(len(self.dnodes)))
        else:
            groups = cfg.prefill // cfg.cpp
            self.pnodes = [_PNode(i, cfg.cache_tokens * cfg.cpp, cfg.block_tokens) for i in range(groups)]
            self.dnodes = [_DNode(i) for i in range(cfg.decode)]
            self.pids = list(range(groups))
        for i in self.pids:
            self.index.add_node(i)
        self.dids = list(range(len(self.dnodes)))
        # accounting
        self.served: list[_Req] = []
        self.rejected = 0
        self.reject_reasons: dict[str, int] = {}
        self.prefill_busy_s = 0.0
        self.fetches = 0
        self.fetched_tokens = 0
        self.replicas: dict[int, list[tuple[float, int]]] = {}
        self.hits: list[tuple[float, int, int]] = []     # (prefill start, cached, prompt)

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> SimResult:
        """Simulates the whole trace; returns the summary and per-request arrays."""
        wall0 = time.perf_counter()
        cfg = self.cfg
        reqs = []
        for i, r in enumerate(self.trace):
            out = cfg.output_tokens if cfg.output_tokens is not None else max(1, r.output_tokens)
            q = _Req(i, r, r.arrival_s * cfg.time_scale, out)
            reqs.append(q)
            self._push(q.arrival, _ARRIVE, q)
        tracked = self._tracked_keys()
        span = (reqs[-1].arrival - reqs[0].arrival) if reqs else 0.0
        sample_every = span / max(1, cfg.replica_samples) if span > 0 else math.inf
        next_sample = reqs[0].arrival if reqs else 0.0
        ev = self.events
        pop = heapq.heappop
        while ev:
            t, _, kind, a, b = pop(ev)
            if kind == _ARRIVE:
                while t >= next_sample and tracked:
                    for rank, key in tracked.items():
                        self.replicas.setdefault(rank, []).append((next_sample, self.index.replicas(key)))
                    next_sample += sample_every
                self._arrive(a, t)
            elif kind == _SEG_END:
                if a.version == b:
                    self._boundary(a, t)
            elif kind == _KV_READY:
                self._kv_ready(a, b, t)
            elif kind == _PF_DONE:
                self._pf_done(a, t, b)
            elif kind == _STAGE_FREE:
                a.running = None
                if not a.waiting_fetch:
                    self._pstart(a, t)
            elif kind == _RESERVE_END:
                if a.running is None:
                    self._pstart(a, t)
            elif kind == _CP_DONE:
                self._cp_done(a, t)
            elif kind == _FETCH_DONE:
                self._fetch_done(a, b, t)
            elif kind == _PF_START:
                a.waiting_fetch = False
                if a.running is None:
                    self._pstart(a, t)
        return self._result(reqs, span, time.perf_counter() - wall0)

    def _tracked_keys(self) -> dict[int, object]:
        """rank -> key of that popularity rank (by number of requests using it)."""
        counts: dict = {}
        for r in self.trace:
            for k in r.keys:
                counts[k] = counts.get(k, 0) + 1
        order = sorted(counts, key=lambda k: -counts[k])
        return {rank: order[rank - 1] for rank in self.cfg.replica_ranks if rank <= len(order)}

    # ------------------------------------------------------------------ placement

    def _snapshot(self, q: _Req, t: float) -> Snapshot:
        match = self.index.match(q.keys, self.pids)
        if self.coupled:
            queue = [max(0.0, d.pf_until - t) + d.pq_pred for d in self.dnodes]
            return Snapshot(self.pids, queue, match)
        queue = [max(0.0, p.busy_until - t) + p.queued_pred for p in self.pnodes]
        ds = self.dnodes
        cap = self.cfg.decode_kv_tokens
        queued = [p.work() for p in self.pnodes] if self.spf else ()
        pend, pend_s = (), ()
        if self.track_pending:
            pend, pend_s = self._pending(q, t, match)
        free = ([max(0.0, p.busy_until - t, p.reserved_until - t)
                 if not p.queue and not p.waiting_fetch else math.inf
                 for p in self.pnodes] if self.elastic else ())
        return Snapshot(self.pids, queue, match, self.dids,
                        [len(d.batch) + d.pending_n for d in ds],
                        [d.ctx + d.pending_ctx for d in ds],
                        [cap - d.committed for d in ds], prefill_queued_s=queued,
                        pending_prefix_blocks=pend, pending_ready_s=pend_s, prefill_free_s=free)

    def _pending(self, q: _Req, t: float, match: list[int]) -> tuple[list[int], list[float]]:
        """Per prefill node: the request's prefix blocks held or to be stored by a prefill
        queued or running there, and the predicted seconds until that prefill is done."""
        pend, ready = [], []
        keys = q.keys
        for p, m in zip(self.pnodes, match):
            j, prod = m, None
            pk = p.pending
            while j < len(keys) and keys[j] in pk:
                prod = pk[keys[j]]
                j += 1
            if prod is None:
                pend.append(m)
                ready.append(0.0)
                continue
            rest = max(0.0, p.busy_until - t)
            if prod is p.running:
                r = rest
            elif prod.pf_end == prod.pf_end:   # an elastic pipeline: done at its end
                r = max(0.0, prod.pf_end - t)
            else:
                before, pred = 0.0, 0.0
                for x in p.queue:              # FCFS: everything queued before it runs first
                    if x[0] is prod:
                        pred = x[2]
                        break
                    before += x[2]
                r = rest + (p.work().ahead(pred)[0] if self.spf else before + pred)
            pend.append(j)
            ready.append(r)
        return pend, ready

    def _arrive(self, q: _Req, t: float) -> None:
        snap = self._snapshot(q, t)
        res = place(PlacementRequest(q.keys, q.n, q.out), snap, self.cost, self.pcfg, self.rng)
        if isinstance(res, Rejection):
            self.rejected += 1
            self.reject_reasons[res.reason] = self.reject_reasons.get(res.reason, 0) + 1
            return
        self.served.append(q)
        if self.coupled:
            d = self.dnodes[res.prefill]
            d.pq.append((q, res.predicted_prefill_s))
            d.pq_pred += res.predicted_prefill_s
            q.decode = d.idx
            self._kick(d, t)
            return
        p = self.pnodes[res.prefill]
        ready = t
        if res.fetch is not None:
            ready = t + res.predicted_transfer_s
            self.fetches += 1
            self.fetched_tokens += res.fetch.tokens
            self._push(ready, _FETCH_DONE, p, (res.fetch.source, res.fetch.keys))
        if res.decode is not None:
            d = self.dnodes[res.decode]
            q.decode = d.idx
            d.pending_n += 1
            d.pending_ctx += q.n
            d.committed += q.need
        if res.helpers:
            self._pipeline_start(p, q, res, t)
            return
        after = None
        if res.waits_for_pending:
            after = p.pending.get(q.keys[res.prefix_blocks - 1])
        # spf starvation bound: aging_s, or the FCFS wait it sees now plus the slack
        q.bound = spf_bound_s(self.pcfg.aging_s,
                              max(0.0, p.busy_until - t) + p.queued_pred, self.pcfg.fcfs_slack_s,
                              self.pcfg.fcfs_slack_ratio)
        p.queue.append((q, ready, res.predicted_prefill_s, after))
        p._work = None
        if self.track_pending:
            for k in q.keys:
                p.pending.setdefault(k, q)
        p.queued_pred += res.predicted_prefill_s
        if p.running is None and (self.spf or not p.waiting_fetch):
            self._pstart(p, t)

    # ------------------------------------------------------------------ prefill (disaggregated)

    def _store(self, node: int, cache: LRUCache, keys) -> None:
        new, evicted = cache.insert(keys)
        if new:
            self.index.stored(node, new)
        if evicted:
            self.index.evicted(node, evicted)

    def _fetch_done(self, p: _PNode, fetch, t: float) -> None:
        src, keys = fetch
        self.pnodes[src].cache.touch(keys)    # a read is a use of the source's replica
        self._store(p.idx, p.cache, keys)

    def _pstart(self, p: _PNode, t: float) -> None:
        if not p.queue or t < p.reserved_until:    # a reservation's end calls again
            return
        if self.spf:
            # shortest predicted prefill first among those whose fetched blocks are in,
            # the oldest first once it waited aging_s (policy.spf_pick)
            # ready: its fetched blocks are in and the prefill it waits for (if any) is done
            ready_k = [k for k, x in enumerate(p.queue)
                       if x[1] <= t and (x[3] is None or x[3].first == x[3].first)]
            if not ready_k:
                later = [x[1] for x in p.queue if x[1] > t]
                if later and not p.waiting_fetch:
                    p.waiting_fetch = True
                    self._push(min(later), _PF_START, p)
                return
            k = ready_k[spf_pick([(p.queue[k][0].arrival, p.queue[k][2], p.queue[k][0].bound)
                                  for k in ready_k],
                                 t, self.pcfg.aging_s, self.bound_on_start)]
            q, ready, pred, _ = p.queue[k]
            del p.queue[k]
        else:
            q, ready, pred, _ = p.queue[0]
            if ready > t:              # FIFO: the head waits for its fetched blocks
                if not p.waiting_fetch:
                    p.waiting_fetch = True
                    self._push(ready, _PF_START, p)
                return
            p.queue.popleft()
        p.queued_pred -= pred
        p._work = None
        m = p.cache.match(q.keys)
        p.cache.touch(q.keys[:m])
        c = min(m * self.cfg.block_tokens, q.n)
        q.cached = c
        dur = self.cost.prefill_s(q.n - c, c)
        self.prefill_busy_s += self.base_cost.prefill_s(q.n - c, c)
        self.hits.append((t, c, q.n))
        q.pf_start = t
        p.running = q
        if self.cfg.cpp > 1:  # the next request enters once stage 0 is done with this one
            occ = self.cost.timing(q.n - c, c).occupancy_s
            p.busy_until = t + occ
            self._push(t + occ, _STAGE_FREE, p)
            self._push(t + dur, _PF_DONE, p, q)
            return
        p.busy_until = t + dur
        self._push(t + dur, _PF_DONE, p)

    def _pipeline_start(self, p: _PNode, q: _Req, res, t: float) -> None:
        """An elastic pipeline over p (stage 0) and res.helpers, none of which has anything
        queued: stage 0 starts res.predicted_ttft_s - latency from now, stage j a step
        later (policy._pipeline_choice; a helper may finish its running prefill first),
        and all run as the placement predicted (the prefix it reuses is the placement's:
        its fetch lands before the start). Each stage node is reserved until its part is
        done: nothing else starts there before."""
        tm = res.pipeline
        start = t + max(0.0, res.predicted_ttft_s - tm.latency_s)
        c = res.prefix_tokens
        q.cached = c
        self.prefill_busy_s += self.base_cost.prefill_s(q.n - c, c)
        self.hits.append((start, c, q.n))
        self.pipelined += 1
        q.pf_start = start
        q.pf_end = start + tm.latency_s
        p.cache.touch(q.keys[:res.local_prefix_blocks])
        k = len(res.helpers) + 1
        step = (tm.latency_s - tm.occupancy_s) / (k - 1)
        for j, node in enumerate([p] + [self.pnodes[h] for h in res.helpers]):
            free = start + tm.occupancy_s + j * step
            node.reserved_until = max(node.reserved_until, free)
            node.busy_until = max(node.busy_until, free)
            self._push(free, _RESERVE_END, node)
        if self.track_pending:
            for key in q.keys:
                p.pending.setdefault(key, q)
        self._push(start + tm.latency_s, _PF_DONE, p, q)

    def _pf_done(self, p: _PNode, t: float, pipelined: _Req | None = None) -> None:
        q = pipelined or p.running
        if pipelined is None:
            p.running = None
        q.first = t
        self._store(p.idx, p.cache, q.keys)
        if self.track_pending:
            for k in q.keys:
                if p.pending.get(k) is q:
                    del p.pending[k]
        if q.remaining <= 0:
            q.done = t
            if q.decode >= 0:
                d = self.dnodes[q.decode]
                d.pending_n -= 1
                d.pending_ctx -= q.n
                d.committed -= q.need
        else:
            # KV streams to the decode node layer by layer while the prefill runs.
            ready = max(t, q.pf_start + self.cost.transfer_s(q.n))
            self._push(ready, _KV_READY, self.dnodes[q.decode], q)
        if pipelined is None or (p.running is None and not p.waiting_fetch):
            self._pstart(p, t)       # a request waiting for this one's prefix may go now

    # ------------------------------------------------------------------ decode

    def _kv_ready(self, d: _DNode, q: _Req, t: float) -> None:
        d.waiting.append(q)
        self._kick(d, t)

    def _kick(self, d: _DNode, t: float) -> None:
        """Something arrived at `d`: act now if idle, else at the end of the current step."""
        if d.prefilling is not None:
            return                       # _cp_done calls _boundary
        if d.seg is None:
            self._boundary(d, t)
            return
        j = int(np.searchsorted(d.seg, t, "left"))
        if j + 1 < d.seg_n:
            d.seg_n = j + 1
            d.version += 1
            self._push(float(d.seg[j]), _SEG_END, d, d.version)

    def _boundary(self, d: _DNode, t: float) -> None:
        """End of a decode segment (or idle): retire finished requests, admit new ones."""
        if d.seg is not None:
            seg, n = d.seg, d.seg_n
            d.seg = None
            ref = (seg, n)
            keep = []
            for q in d.batch:
                q.segs.append(ref)
                q.remaining -= n
                if q.remaining <= 0:
                    q.done = float(seg[n - 1])
                    d.used -= q.need
                    d.committed -= q.need
                    d.ctx -= q.n + q.out - 1 - n     # its context at the segment start
                else:
                    keep.append(q)
                    d.ctx += n
            d.batch = keep
        cap = self.cfg.decode_kv_tokens
        if d.pq:                                          # coupled: prompts first
            q, pred = d.pq[0]
            if len(d.batch) < self.cfg.max_batch and (d.used + q.need <= cap or not d.batch):
                d.pq.popleft()
                self._cp_start(d, q, pred, t)
                return
        while d.waiting and len(d.batch) < self.cfg.max_batch and (
                d.used + d.waiting[0].need <= cap or not d.batch):
            q = d.waiting.popleft()
            d.pending_n -= 1
            d.pending_ctx -= q.n
            d.used += q.need
            d.ctx += q.n
            d.batch.append(q)
        if d.batch:
            self._start_segment(d, t)

    def _start_segment(self, d: _DNode, t: float) -> None:
        b = len(d.batch)
        k = min(_MAX_SEG_STEPS, min(q.remaining for q in d.batch))
        ctx = d.ctx + b * np.arange(k, dtype=np.float64)
        dt = np.maximum(self.cost.decode.grid(b, ctx), 0.0)
        d.seg = t + np.cumsum(dt)
        d.seg_n = k
        d.version += 1
        self._push(float(d.seg[k - 1]), _SEG_END, d, d.version)

    # ------------------------------------------------------------------ coupled prefill

    def _cp_start(self, d: _DNode, q: _Req, pred: float, t: float) -> None:
        d.pq_pred = max(0.0, d.pq_pred - pred)
        m = d.cache.match(q.keys)
        d.cache.touch(q.keys[:m])
        c = min(m * self.cfg.block_tokens, q.n)
        q.cached = c
        dur = self.cost.prefill_s(q.n - c, c)
        self.prefill_busy_s += dur
        self.hits.append((t, c, q.n))
        d.prefilling = q
        d.pf_until = t + dur
        d.used += q.need
        d.committed += q.need
        self._push(t + dur, _CP_DONE, d)

    def _cp_done(self, d: _DNode, t: float) -> None:
        q = d.prefilling
        d.prefilling = None
        q.first = t
        self._store(d.idx, d.cache, q.keys)
        if q.remaining <= 0:
            q.done = t
            d.used -= q.need
            d.committed -= q.need
        else:
            d.batch.append(q)
            d.ctx += q.n
        self._boundary(d, t)

    # ------------------------------------------------------------------ results

    def _result(self, reqs: list[_Req], span: float, wall_s: float) -> SimResult:
        cfg = self.cfg
        served = self.served
        ttft = np.array([q.first - q.arrival for q in served])
        tbts = []
        for q in served:
            if q.segs:
                times = np.concatenate([[q.first]] + [s[:n] for s, n in q.segs])
                tbts.append(tbt_s(times.tolist()))
            else:
                tbts.append(0.0)
        tbt = np.array(tbts)
        prompt = sum(q.n for q in served)
        cached = sum(q.cached for q in served)
        ttl, tbl = ttft.tolist(), tbts
        erc = {f"{thr:g}": effective_request_capacity(ttl, tbl, cfg.ttft_threshold_s, thr,
                                                      self.rejected)
               for thr in cfg.tbt_thresholds_s}
        n_nodes = (cfg.prefill + cfg.decode)
        summary = {
            "policy": cfg.policy, "prefill": cfg.prefill if not self.coupled else 0,
            "decode": cfg.decode if not self.coupled else 0,
            "coupled": n_nodes if self.coupled else 0,
            "cache_tokens": cfg.cache_tokens if math.isfinite(cfg.cache_tokens) else "inf",
            "time_scale": cfg.time_scale,
            "requests": len(reqs), "completed": len(served), "rejected": self.rejected,
            "reject_reasons": self.reject_reasons,
            "arrival_rate_rps": len(reqs) / span if span > 0 else math.inf,
            "cache_hit_rate": cache_hit_rate(cached, prompt),
            "ttft_mean_s": float(ttft.mean()) if len(ttft) else math.nan,
            "ttft_p50_s": percentile(ttl, 50), "ttft_p90_s": percentile(ttl, 90),
            "ttft_p99_s": percentile(ttl, 99),
            "ttft_max_s": float(ttft.max()) if len(ttft) else math.nan,
            "tbt_mean_s": float(tbt.mean()) if len(tbt) else math.nan,
            "tbt_p90_s": percentile(tbl, 90), "tbt_p99_s": percentile(tbl, 99),
            "ttft_threshold_s": cfg.ttft_threshold_s,
            "effective_request_capacity": erc[f"{cfg.tbt_thresholds_s[0]:g}"],
            "effective_request_capacity_by_tbt": erc,
            "prefill_compute_s_per_request": self.prefill_busy_s / len(served) if served else 0.0,
            "fetches": self.fetches, "fetched_tokens": self.fetched_tokens,
            "pipelined": self.pipelined,
            "makespan_s": max((q.done for q in served), default=0.0),
            "sim_wall_s": wall_s,
            "cost_model": self.cost.name,
        }
        windows = self._hit_windows()
        summary["hit_rate_by_window"] = [[round(t, 1), round(h, 4)] for t, h in windows]
        return SimResult(summary, ttft, tbt, self.replicas, windows)

    def _hit_windows(self) -> list[tuple[float, float]]:
        """Hit rate per window of prefill start times: (window middle, hit rate)."""
        if not self.hits:
            return []
        h = np.array(self.hits, dtype=np.float64)
        lo, hi = h[:, 0].min(), h[:, 0].max()
        k = max(1, self.cfg.hit_windows)
        edges = np.linspace(lo, hi + 1e-9, k + 1)
        w = np.clip(np.searchsorted(edges, h[:, 0], "right") - 1, 0, k - 1)
        cached = np.bincount(w, weights=h[:, 1], minlength=k)
        prompt = np.bincount(w, weights=h[:, 2], minlength=k)
        mid = (edges[:-1] + edges[1:]) / 2
        return [(float(m), cache_hit_rate(float(c), float(p)))
                for m, c, p in zip(mid, cached, prompt) if p > 0]


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig, cost: CostModel | None = None) -> SimResult:
    """Simulates `trace` on the cluster `cfg` with `cost` (default: the paper's setting).

    Returns a SimResult whose `summary` has at least: requests, completed, rejected,
    cache_hit_rate, ttft_mean_s, ttft_p90_s, tbt_mean_s, effective_request_capacity
    (share of requests with TTFT <= ttft_threshold_s and TBT <= the first of
    tbt_thresholds_s; rejected requests count as misses), prefill_compute_s_per_request.
    Raises: ValueError on a bad configuration.
    """
    return Simulator(trace, cfg, cost).run()


def config_dict(cfg: SimConfig) -> dict:
    """JSON-ready view of a SimConfig (inf as the string "inf")."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(cfg).items()}
