"""The pure placement function (Mooncake Algorithm 1 and its baselines) on hand-made snapshots."""

import math
import random

import pytest

from mooncaked.conductor.cost_model import DECODE_TERMS, PREFILL_TERMS, CostModel, PolyModel, TransferModel
from mooncaked.conductor.index import PrefixIndex
from mooncaked.conductor.policy import (Placement, PlacementRequest, PolicyConfig, Rejection,
                                        Snapshot, place)

BS = 100  # tokens a block in these tests

# Prefill: 1 ms per new token; decode: 10 ms + 1 ms per request in the batch;
# transfer: 1000 bytes a token at 1 GB/s = 1 us per token.
COST = CostModel(prefill=PolyModel(PREFILL_TERMS, (0.0, 1e-3, 0.0, 0.0, 0.0)),
                 decode=PolyModel(DECODE_TERMS, (0.01, 1e-3, 0.0)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000)
KEYS = list(range(10))      # 10 blocks = 1000 tokens
REQ = PlacementRequest(KEYS, 1000, 100)


def snap(queue, prefix, dbatch=(0,), dfree=(math.inf,)):
    return Snapshot(prefill_nodes=[f"p{i}" for i in range(len(queue))], prefill_queue_s=queue,
                    prefix_blocks=prefix, decode_nodes=[f"d{i}" for i in range(len(dbatch))],
                    decode_batch=list(dbatch), decode_context_tokens=[0] * len(dbatch),
                    decode_free_kv_tokens=list(dfree))


def cfg(policy="global_cache_aware", **kw):
    return PolicyConfig(policy=policy, block_size=BS, **kw)


@pytest.mark.parametrize("policy", ["local_cache_aware", "global_cache_aware"])
def test_longest_prefix_wins_when_queues_are_equal(policy):
    p = place(REQ, snap([1.0, 1.0, 1.0], [2, 8, 5]), COST, cfg(policy))
    assert isinstance(p, Placement)
    assert p.prefill == "p1" and p.fetch is None
    assert p.prefix_blocks == 8 and p.prefix_tokens == 800
    assert p.predicted_prefill_s == pytest.approx(0.2)        # 200 new tokens
    assert p.predicted_ttft_s == pytest.approx(1.2)


def test_local_picks_another_node_when_queue_dominates():
    # p1 holds 8 blocks but has 5 s queued; p0 (no cache) finishes in 1 s.
    p = place(REQ, snap([0.0, 5.0], [0, 8]), COST, cfg("local_cache_aware"))
    assert p.prefill == "p0" and p.prefix_blocks == 0 and p.fetch is None
    assert p.predicted_ttft_s == pytest.approx(1.0)


def test_global_fetches_the_prefix_to_an_idle_node():
    # Same state: global cache-aware fetches p1's 8 blocks to p0 rather than recompute.
    p = place(REQ, snap([0.0, 5.0], [0, 8]), COST, cfg())
    assert p.prefill == "p0" and p.local_prefix_blocks == 0 and p.prefix_blocks == 8
    assert p.fetch.source == "p1" and p.fetch.keys == tuple(KEYS[:8]) and p.fetch.tokens == 800
    assert p.predicted_transfer_s == pytest.approx(800e-6)
    assert p.predicted_ttft_s == pytest.approx(800e-6 + 0.2)


def test_cache_node_holding_the_prefix_is_the_fetch_source():
    import dataclasses
    # c0 (a cache node) holds all 10 blocks, p1 holds 8 and is busy, p0 holds nothing.
    state = dataclasses.replace(snap([0.0, 5.0], [0, 8]), holder_nodes=["c0"],
                                holder_prefix_blocks=[10])
    p = place(REQ, state, COST, cfg())
    assert p.prefill == "p0" and p.fetch.source == "c0" and p.prefix_blocks == 10
    assert p.fetch.keys == tuple(KEYS) and p.prefix_tokens == 1000
    # holding as much as a prefill node, the cache node is still preferred as the source
    tie = dataclasses.replace(state, holder_prefix_blocks=[8])
    assert place(REQ, tie, COST, cfg()).fetch.source == "c0"
    # the local policy ignores holders; a shorter holder changes nothing
    assert place(REQ, state, COST, cfg("local_cache_aware")).fetch is None
    short = dataclasses.replace(state, holder_prefix_blocks=[3])
    assert place(REQ, short, COST, cfg()).fetch.source == "p1"
    with pytest.raises(ValueError):
        Snapshot(["p0"], [0.0], [0], holder_nodes=["c0"])


def test_fetch_or_recompute_by_threshold():
    # p0 holds 6 blocks and is idle, p1 holds 10 and is busy: best/own = 1.67.
    state = snap([0.0, 3.0], [6, 10])
    low = place(REQ, state, COST, cfg(cache_balance_threshold=1.5))
    assert low.prefill == "p0" and low.fetch is not None
    assert (low.fetch.first_block, low.fetch.tokens, low.prefix_blocks) == (6, 400, 10)
    high = place(REQ, state, COST, cfg(cache_balance_threshold=2.0))
    assert high.prefill == "p0" and high.fetch is None and high.prefix_blocks == 6
    assert high.predicted_prefill_s == pytest.approx(0.4)
    # Above the threshold but on a slow network (1 MB/s: 1 ms a token, like recomputing
    # plus latency), recomputing wins.
    slow = CostModel(COST.prefill, COST.decode, TransferModel(1e6, latency_s=0.05), 1000)
    r = place(REQ, state, slow, cfg(cache_balance_threshold=1.5))
    assert r.prefill == "p0" and r.fetch is None and r.prefix_blocks == 6


def test_load_balancing_and_random():
    p = place(REQ, snap([3.0, 0.5, 2.0], [10, 0, 10]), COST, cfg("load_balancing"))
    assert p.prefill == "p1" and p.prefix_blocks == 0
    picks = {place(REQ, snap([0, 0, 0], [0, 0, 0]), COST, cfg("random"), random.Random(s)).prefill
             for s in range(30)}
    assert picks == {"p0", "p1", "p2"}
    a = [place(REQ, snap([0] * 8, [0] * 8), COST, cfg("random"), random.Random(7)).prefill
         for _ in range(3)]
    assert len(set(a)) == 1                       # same rng state, same pick
    with pytest.raises(ValueError, match="needs an rng"):
        place(REQ, snap([0], [0]), COST, cfg("random"))


def test_decode_by_load_and_kv_room():
    p = place(REQ, snap([0.0], [0], dbatch=(30, 5, 1), dfree=(1e6, 1e6, 500)), COST, cfg())
    assert p.decode == "d1"                       # d2 is lighter but has no room for 1100 tokens
    assert p.predicted_tbt_s == pytest.approx(0.01 + 6e-3)


def test_rejects_when_slo_broken():
    r = place(REQ, snap([12.0, 9.5], [0, 0]), COST, cfg(ttft_slo_s=5.0))
    assert isinstance(r, Rejection) and r.reason == "ttft_slo"
    assert r.predicted_ttft_s == pytest.approx(10.5)
    assert r.retry_after_s == pytest.approx(5.5)
    r = place(REQ, snap([0.0], [0], dbatch=(100,)), COST, cfg(tbt_slo_s=0.1))
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"
    assert r.predicted_tbt_s == pytest.approx(0.111) and r.retry_after_s == 1.0
    r = place(REQ, snap([0.0], [0], dfree=(10,)), COST, cfg(tbt_slo_s=0.1))
    assert r.reason == "decode_full"
    ok = place(REQ, snap([0.0], [0], dbatch=(10,)), COST, cfg(ttft_slo_s=5.0, tbt_slo_s=0.1))
    assert isinstance(ok, Placement) and ok.predicted_tbt_s == pytest.approx(0.021)


def test_with_the_index_and_bad_config():
    ix = PrefixIndex()
    ix.stored("p0", KEYS[:3])
    ix.stored("p1", KEYS[:7])
    nodes = ["p0", "p1", "p2"]
    s = Snapshot(nodes, [0.0, 0.0, 0.0], ix.match(KEYS, nodes))
    p = place(REQ, s, COST, cfg())
    assert (p.prefill, p.prefix_blocks, p.decode) == ("p1", 7, None)
    assert isinstance(place(REQ, Snapshot([], [], []), COST, cfg()), Rejection)
    with pytest.raises(ValueError, match="unknown placement policy"):
        PolicyConfig(policy="fastest")
    with pytest.raises(ValueError, match="differ in length"):
        Snapshot(["a"], [0.0, 1.0], [0])
