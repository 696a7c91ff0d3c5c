"""Fetch or recompute by each path's measured bandwidth (Snapshot.path_bytes_per_s, issue 34):
the pure placement function on hand-made snapshots, under both fetch rules (Algorithm 1's
threshold and the cost rule) and in an elastic pipeline's fetch.

Cost model of these tests: prefill 1 ms a new token, transfer 1000 bytes a token at the
model's 1 GB/s (1 ms for 1000 tokens); a slow path of 100 kB/s moves the same 1 MB in 10 s.
"""

import math
import random

import pytest

from mooncaked.conductor.cost_model import (DECODE_TERMS, PREFILL_TERMS, CostModel, PolyModel,
                                            TransferModel)
from mooncaked.conductor.policy import Placement, PlacementRequest, PolicyConfig, Snapshot, place

BS = 100                                       # tokens a block
COST = CostModel(prefill=PolyModel(PREFILL_TERMS, (0.0, 1e-3, 0.0, 0.0, 0.0)),
                 decode=PolyModel(DECODE_TERMS, (0.01, 1e-3, 0.0)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000)
REQ = PlacementRequest(list(range(10)), 1000, 10)     # 10 blocks = 1000 tokens
SLOW, FAST = 1e5, 1e9                           # bytes/s
RULES = ["threshold", "cost"]


def snap(queue, prefix, holders=(), holder_blocks=(), paths=None, **kw) -> Snapshot:
    return Snapshot(prefill_nodes=[f"p{i}" for i in range(len(queue))], prefill_queue_s=queue,
                    prefix_blocks=prefix, decode_nodes=["d0"], decode_batch=[0],
                    decode_context_tokens=[0], decode_free_kv_tokens=[math.inf],
                    holder_nodes=list(holders), holder_prefix_blocks=list(holder_blocks),
                    path_bytes_per_s=paths or {}, **kw)


def cfg(rule: str, **kw) -> PolicyConfig:
    return PolicyConfig(policy="global_cache_aware", block_size=BS, fetch_rule=rule, **kw)


@pytest.mark.parametrize("rule", RULES)
def test_a_slow_path_makes_its_node_recompute_and_a_fast_one_makes_another_fetch(rule):
    # c0 (a cache node) holds the whole prompt; p0 and p1 hold nothing
    free = snap([0.0, 0.1], [0, 0], ["c0"], [10])
    p = place(REQ, free, COST, cfg(rule))                  # no measured path: the model's 1 GB/s
    assert p.prefill == "p0" and p.fetch.source == "c0" and p.prefix_blocks == 10
    assert p.predicted_transfer_s == pytest.approx(1e-3)

    # c0 -> p0 measured at 100 kB/s (10 s for the prefix), c0 -> p1 at 1 GB/s: p1 fetches
    paths = {("c0", "p0"): SLOW, ("c0", "p1"): FAST}
    p = place(REQ, snap([0.0, 0.1], [0, 0], ["c0"], [10], paths), COST, cfg(rule))
    assert p.prefill == "p1" and p.fetch.source == "c0" and p.prefix_tokens == 1000
    assert p.predicted_transfer_s == pytest.approx(1e-3)
    assert p.predicted_ttft_s == pytest.approx(0.1 + (1e-3 if rule == "threshold" else 0.0))

    # p1 busier (2 s): p0 is placed, and behind its slow path it recomputes (1 s) rather
    # than fetch (10 s)
    p = place(REQ, snap([0.0, 2.0], [0, 0], ["c0"], [10], paths), COST, cfg(rule))
    assert p.prefill == "p0" and p.fetch is None and p.prefix_blocks == 0
    assert p.predicted_ttft_s == pytest.approx(1.0)


@pytest.mark.parametrize("rule", RULES)
def test_the_path_rate_decides_where_the_model_rate_would_not(rule):
    # one prefill node; at the model's rate a 1 GB/s fetch wins, at a measured 100 kB/s the
    # node recomputes, at a measured 10 GB/s it fetches in a tenth of the model's time
    state = dict(queue=[0.0], prefix=[0], holders=["c0"], holder_blocks=[10])
    assert place(REQ, snap(**state), COST, cfg(rule)).fetch.source == "c0"
    slow = place(REQ, snap(**state, paths={("c0", "p0"): SLOW}), COST, cfg(rule))
    assert slow.fetch is None and slow.predicted_ttft_s == pytest.approx(1.0)
    fast = place(REQ, snap(**state, paths={("c0", "p0"): 1e10}), COST, cfg(rule))
    assert fast.fetch.source == "c0" and fast.predicted_transfer_s == pytest.approx(1e-4)
    # the fixed baseline fetches whatever the path costs, at the path's predicted time
    always = place(REQ, snap(**state, paths={("c0", "p0"): SLOW}), COST,
                   cfg(rule, fetch_policy="always"))
    assert always.fetch.source == "c0" and always.predicted_transfer_s == pytest.approx(10.0)
    # a path's rate in the other direction (p0 -> c0), or into another node, is not this one
    other = {("p0", "c0"): SLOW, ("c0", "p9"): SLOW}
    assert place(REQ, snap(**state, paths=other), COST, cfg(rule)).fetch.source == "c0"


def test_a_slow_path_from_the_least_busy_holder_moves_the_fetch_to_another_holder():
    # the cost rule: c0 is idle, c1 has 50 ms of transfers planned; both hold the prompt
    state = dict(queue=[0.0], prefix=[0], holders=["c0", "c1"], holder_blocks=[10, 10],
                 holder_busy_s=[0.0, 0.05])
    p = place(REQ, snap(**state), COST, cfg("cost"))
    assert p.fetch.source == "c0" and p.predicted_transfer_s == pytest.approx(1e-3)
    # c0 -> p0 is slow: the busier c1 (unmeasured: the model's rate) serves it sooner
    p = place(REQ, snap(**state, paths={("c0", "p0"): SLOW}), COST, cfg("cost"))
    assert p.fetch.source == "c1" and p.predicted_transfer_s == pytest.approx(0.05 + 1e-3)
    # a busier prefill node behind a fast path beats both slow holders
    p = place(REQ, snap([0.0, 5.0], [0, 10], paths={("c0", "p0"): SLOW, ("c1", "p0"): SLOW},
                        holders=["c0", "c1"], holder_blocks=[10, 10], holder_busy_s=[0.0, 0.05],
                        prefill_busy_s=[0.0, 0.2]), COST, cfg("cost"))
    assert p.prefill == "p0" and p.fetch.source == "p1"
    assert p.predicted_transfer_s == pytest.approx(0.2 + 1e-3)


def test_threshold_rule_fetches_from_the_holder_behind_the_fastest_path():
    # Algorithm 1 fetches best_len from the first node holding it (c0); with c0 -> p0
    # measured slow and c1 -> p0 fast it takes c1, and with both measured equal c0 again
    state = dict(queue=[0.0], prefix=[0], holders=["c0", "c1"], holder_blocks=[10, 10])
    assert place(REQ, snap(**state), COST, cfg("threshold")).fetch.source == "c0"
    p = place(REQ, snap(**state, paths={("c0", "p0"): SLOW, ("c1", "p0"): FAST}), COST,
              cfg("threshold"))
    assert p.fetch.source == "c1" and p.predicted_transfer_s == pytest.approx(1e-3)
    tie = {("c0", "p0"): FAST, ("c1", "p0"): FAST}
    assert place(REQ, snap(**state, paths=tie), COST, cfg("threshold")).fetch.source == "c0"


def test_an_elastic_pipeline_fetches_over_the_faster_path_or_recomputes():
    req = PlacementRequest(list(range(40)), 4000, 10)            # 40 blocks, 4000 tokens
    conf = PolicyConfig(policy="cost_aware", block_size=BS, pipeline_min_tokens=1000,
                        pipeline_chunk_tokens=500, pipeline_hidden_bytes_per_token=100)

    def run(paths):
        return place(req, snap([0.0, 0.0], [0, 0], ["c0", "c1"], [20, 20], paths,
                               holder_busy_s=[0.0, 0.05], prefill_free_s=[0.0, 0.0]), COST, conf)

    p = run({})
    assert p.pipeline is not None and p.helpers and p.fetch.source == "c0"
    assert p.prefix_blocks == 20 and p.predicted_transfer_s == pytest.approx(2e-3)
    # c0 slow into both nodes: the pipeline's primary fetches from c1 instead
    p = run({("c0", "p0"): SLOW, ("c0", "p1"): SLOW})
    assert p.pipeline is not None and p.fetch.source == "c1"
    assert p.predicted_transfer_s == pytest.approx(0.05 + 2e-3)
    # every path slow (20 s for the prefix): it recomputes the whole prompt
    slow = {(s, d): SLOW for s in ("c0", "c1") for d in ("p0", "p1")}
    p = run(slow)
    assert p.fetch is None and p.prefix_blocks == 0


def test_unusable_rates_count_as_not_measured():
    state = dict(queue=[0.0], prefix=[0], holders=["c0"], holder_blocks=[10])
    for bad in (0.0, -1.0, math.inf, math.nan):
        p = place(REQ, snap(**state, paths={("c0", "p0"): bad}), COST, cfg("cost"))
        assert p.fetch.source == "c0" and p.predicted_transfer_s == pytest.approx(1e-3)


def _random_case(rng: random.Random):
    np_, nh, nb = rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 12)
    pick = lambda: rng.choice([0, rng.randint(0, nb), nb, nb // 2])  # noqa: E731
    pn, hn = [f"p{k}" for k in range(np_)], [f"h{k}" for k in range(nh)]
    kw = dict(holder_nodes=hn, holder_prefix_blocks=[pick() for _ in hn])
    if rng.random() < 0.5:
        kw["prefill_busy_s"] = [rng.choice([0.0, rng.uniform(0, 2)]) for _ in pn]
        kw["holder_busy_s"] = [rng.choice([0.0, rng.uniform(0, 2)]) for _ in hn]
    if rng.random() < 0.3:
        kw["prefill_free_s"] = [rng.choice([0.0, rng.uniform(0, 3), math.inf]) for _ in pn]
    own = [pick() for _ in pn]
    if rng.random() < 0.3:
        kw["pending_prefix_blocks"] = [max(m, pick()) for m in own]
        kw["pending_ready_s"] = [rng.uniform(0, 3) for _ in pn]
    conf = dict(policy=rng.choice(["global_cache_aware", "cost_aware"]), block_size=BS,
                fetch_policy=rng.choice(["adaptive", "adaptive", "always", "never"]),
                fetch_rule=rng.choice(["", "threshold", "cost"]),
                pipeline_stages=rng.choice([0, 1, 2]), pipeline_min_tokens=rng.choice([0, 500]))
    req = PlacementRequest(list(range(nb)), rng.randint(1, nb * BS), rng.randint(0, 100))
    queue = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in pn]
    base = Snapshot(pn, queue, own, decode_nodes=["d0"], decode_batch=[rng.randint(0, 4)],
                    decode_context_tokens=[rng.randint(0, 5000)],
                    decode_free_kv_tokens=[rng.randint(0, 50000)], **kw)
    return req, base, PolicyConfig(**conf), pn + hn, pn


def test_no_measured_path_or_every_path_at_the_model_rate_decides_as_before():
    # the simulator's default (no paths) is the old decision by construction; every path
    # measured at exactly the model's rate, or paths that no fetch reads, change nothing
    rng = random.Random(34)
    fetched = 0
    for _ in range(3000):
        req, base, conf, sources, dests = _random_case(rng)
        p = place(req, base, COST, conf)
        fetched += isinstance(p, Placement) and p.fetch is not None
        same = {(s, d): COST.transfer.bandwidth_bytes_per_s for s in sources for d in dests}
        # prefill node -> cache node: the other way, never a fetch's path
        unread = {(d, h): SLOW for h in base.holder_nodes for d in dests}
        for paths in (same, unread):
            q = place(req, Snapshot(**{**base.__dict__, "path_bytes_per_s": paths}), COST, conf)
            assert repr(q) == repr(p), (base, conf, paths)
    assert fetched > 300            # the cases exercise the fetch decision
