"""Placement on CPP groups (conductor/cpp_place.py): which prefill nodes form groups, and
group or single node by predicted TTFT and cpp_min_tokens. Pure functions, no processes."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
from mooncaked.conductor.cpp_cost import PipelinedCostModel, stage_timing
from mooncaked.conductor.cpp_place import (GroupLearner, fold_factors, group_chunk_prediction, group_prefix,
                                           place_with_groups, split_groups, stage_factor_sample)
from mooncaked.conductor.load import NodeView, queue_s
from mooncaked.conductor.policy import Placement, PlacementRequest, PolicyConfig, Rejection, Snapshot, place

# prefill 0.05 s + 5 ms a token: a 2,000-token prompt takes 10.05 s on one node
COST = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.05, 0.005)),
                 decode=PolyModel(((0, 0), (1, 0)), (0.01, 0.001)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000, name="t", meta={})


def view(nid: str, group: str = "", stage: int = 0, stages: int = 2, control: bool = True) -> NodeView:
    info = {"role": "prefill"}
    if control:
        info["control"] = f"127.0.0.1:{1000 + len(nid)}"
    if group:
        info["cpp"] = {"group": group, "stage": stage, "stages": stages, "layers": [0, 1],
                       "chunk_tokens": 256, "hidden_bytes_per_token": 2304, "max_tokens": 8192}
    return NodeView(nid, role="prefill", info=info)


def test_split_groups_keeps_complete_groups_and_single_nodes():
    nodes = [view("p"), view("a1", "a", 1), view("a0", "a", 0),      # complete, out of order
             view("b1", "b", 1),                                      # b lacks stage 0
             view("c0", "c", 0, 3), view("c1", "c", 1, 2),            # c's sizes disagree
             view("r")]
    nodes[-1].info.pop("control")                   # known only by report: a single node
    singles, groups = split_groups(nodes)
    assert [v.node_id for v in singles] == ["p", "r"]
    assert [g.name for g in groups] == ["a"]
    assert [v.node_id for v in groups[0].stages] == ["a0", "a1"] and groups[0].head.node_id == "a0"
    assert groups[0].chunk_tokens == 256


def _place(n: int, with_single: bool, min_tokens: int = 1000, learner=None):
    singles, groups = split_groups([view("p"), view("a0", "a", 0), view("a1", "a", 1)])
    if not with_single:
        singles = []
    req = PlacementRequest([], n, 4)
    cfg = PolicyConfig(policy="global_cache_aware", block_size=16)
    snap = Snapshot([v.node_id for v in singles], [0.0] * len(singles), [0] * len(singles),
                    decode_nodes=["d"], decode_batch=[0], decode_context_tokens=[0],
                    decode_free_kv_tokens=[100_000])
    single = place(req, snap, COST, cfg, random.Random(0)) if singles else None
    return single, place_with_groups(single, groups, req, snap, COST, cfg, random.Random(0),
                                     min_tokens, queue_s, learner)


def test_long_prompt_goes_to_the_group_when_predicted_faster():
    single, r = _place(2000, True)
    assert isinstance(single, Placement) and single.prefill == "p"
    assert isinstance(r, Placement) and r.prefill == "a0" and r.decode == "d"
    # 8 chunks of 256 on 2 stages: about half the single node's 10.05 s plus one chunk's bubble
    assert r.predicted_ttft_s < 0.6 * single.predicted_ttft_s


def test_short_prompt_stays_on_the_single_node_but_a_group_alone_serves_it():
    single, r = _place(500, True)
    assert r is single and r.prefill == "p"                 # 500 < cpp_min_tokens
    _, r = _place(500, True, min_tokens=100)                # 2 chunks: the group is faster
    assert r.prefill == "a0"
    _, r = _place(40, False)                                # no single node: one chunk on the group
    assert isinstance(r, Placement) and r.prefill == "a0"
    _, groups = split_groups([view("p")])
    assert place_with_groups(Rejection("ttft_slo", 1.0), groups, PlacementRequest([], 10, 1),
                             Snapshot(["p"], [0.0], [0]), COST, PolicyConfig(block_size=16), None,
                             1000, queue_s).reason == "ttft_slo"


def test_the_group_learns_per_stage_step_times_and_its_overhead():
    _, (g,) = split_groups([view("a0", "a", 0), view("a1", "a", 1)])
    chunk_s, hop = group_chunk_prediction(COST, g, 2000)
    # 7 chunks of 256 and one of 208 on one of 2 stages: (0.05 + 5 ms x tokens) / 2
    assert chunk_s == pytest.approx((0.665,) * 7 + (0.545,)) and hop == pytest.approx(256 * 2304 / 1e9)
    lr = GroupLearner(alpha=0.5)
    # stage 0 runs as predicted, stage 1 at 3x (a slower node); the wall time is 1.2x what
    # the measured chunk times give through the pipeline (hops, RPCs)
    measured = (tuple(chunk_s), tuple(3 * x for x in chunk_s))
    wall = 1.2 * stage_timing(measured, hop).latency_s
    for i in range(8):
        lr.predicted(f"r{i}", "a", chunk_s, hop)
        lr.observe(f"r{i}", wall, 0, measured)
    assert lr.factors("a") == pytest.approx((1.0, 3.0)) and lr.scale("a") == pytest.approx(1.2)
    assert lr.factors("a", 3) == ()                       # learned for another stage count
    st = lr.status()["a"]
    assert (st["samples"], st["stage_samples"], st["stage_factors"]) == (8, 8, [1.0, 3.0])
    # Algorithm 1's TTFT for the group: stage 1's 3 x 5.2 s dominate, stage 0 adds one chunk
    _, r = _place(2000, False, learner=lr)
    assert r.prefill == "a0"
    assert r.predicted_prefill_s == pytest.approx(1.2 * (3 * sum(chunk_s) + 0.665 + hop))
    # ... so the group no longer beats the single node's 10.05 s: the request stays there
    single, r = _place(2000, True, learner=lr)
    assert r is single and r.prefill == "p"
    # Overlapping requests still teach step times (a stage computes one chunk at a time),
    # not the overhead (their wall time holds a queue); prefix hits and other chunkings
    # teach nothing.
    lr.predicted("x", "a", chunk_s, hop)
    lr.predicted("y", "a", chunk_s, hop)
    lr.observe("x", 100.0, 0, measured)
    lr.observe("y", 100.0, 0, measured)
    lr.predicted("z", "a", chunk_s, hop)
    lr.observe("z", 100.0, 32, measured)
    lr.predicted("w", "a", chunk_s, hop)
    lr.observe("w", 100.0, 0, (measured[0][:3], measured[1][:3]))
    lr.observe("unknown", 100.0, 0, measured)
    st = lr.status()["a"]
    assert (st["samples"], st["stage_samples"]) == (8, 10) and lr.scale("a") == pytest.approx(1.2)


def test_stage_factor_samples_and_folding():
    assert stage_factor_sample((1.0, 1.0), ((1.0, 3.0), (0.5, 0.5))) == pytest.approx((2.0, 0.5))
    assert stage_factor_sample((1.0, 1.0), ((1.0,), (0.5, 0.5))) is None    # chunk counts differ
    assert stage_factor_sample((1.0,), ()) is None
    assert stage_factor_sample((1.0,), ((0.0,), (1.0,))) is None
    assert fold_factors((), (2.0, 50.0), 0.3, (0.1, 10.0)) == (2.0, 10.0)   # first: clamped sample
    assert fold_factors((1.0, 1.0), (2.0, 3.0), 0.5, (0.1, 10.0)) == pytest.approx((1.5, 2.0))
    assert fold_factors((1.0, 1.0), (2.0, 3.0, 4.0), 0.5, (0.1, 10.0)) == (2.0, 3.0, 4.0)


def test_group_prefix_is_the_least_stage_prefix_and_each_stage_fetches_its_share():
    layers = ((0, 10), (10, 30))                 # stage 1 holds two thirds of a block
    # stage 0 has 3 blocks of slices, stage 1 has 1; two holders have 5 full blocks
    gp = group_prefix((3, 1), ["c", "p"], [5, 5], layers, 30, 3000)
    assert (gp.blocks, gp.source, gp.first_block) == (5, "c", 1)     # a tie: the first holder
    assert gp.fetch_blocks == (2, 4)
    assert gp.fetch_bytes == (2 * 1000, 4 * 2000)                    # only its layers' bytes
    # in parallel: the slowest stage's transfer, not the sum
    assert gp.fetch_s(COST) == COST.transfer.seconds(8000) < COST.transfer.seconds(10000)
    # a holder shorter than one stage's slices: that stage fetches nothing, the group's
    # prefix is the least stage's
    gp = group_prefix((6, 4), ["c"], [5], layers, 30, 3000)
    assert (gp.blocks, gp.fetch_blocks, gp.source, gp.first_block) == (5, (0, 1), "c", 4)
    # every stage holds more than any holder: no fetch
    gp = group_prefix((6, 8), ["c"], [2], layers, 30, 3000)
    assert (gp.blocks, gp.source, gp.fetch_bytes, gp.fetch_s(COST)) == (6, None, (0, 0), 0.0)
    # a stage with nothing and no holder: no prefix at all
    gp = group_prefix((3, 0), [], [], layers, 30, 3000)
    assert (gp.blocks, gp.source) == (0, None)


def _stage_view(nid: str, stage: int) -> NodeView:
    v = view(nid, "a", stage)
    v.info["cpp"].update(layers=[0, 15] if stage == 0 else [15, 30], num_layers=30,
                         block_bytes=16 * 1000)
    return v


def test_a_group_placement_counts_its_prefix_and_the_stages_fetch():
    n, keys = 2000, [bytes([i]) * 16 for i in range(125)]
    _, groups = split_groups([_stage_view("a0", 0), _stage_view("a1", 1)])
    assert groups[0].layers == ((0, 15), (15, 30)) and groups[0].block_bytes == 16_000
    req = PlacementRequest(keys, n, 4)
    cfg = PolicyConfig(policy="global_cache_aware", block_size=16)
    # single node p holds nothing, cache node c holds 100 blocks (1,600 tokens)
    snap = Snapshot(["p"], [0.0], [0], decode_nodes=["d"], decode_batch=[0],
                    decode_context_tokens=[0], decode_free_kv_tokens=[100_000],
                    holder_nodes=["c"], holder_prefix_blocks=[100])
    cold = place_with_groups(None, groups, req, dataclasses.replace(snap, holder_prefix_blocks=[0]),
                             COST, cfg, None, 0, queue_s)
    r = place_with_groups(None, groups, req, snap, COST, cfg, None, 0, queue_s, None,
                          {"a": (40, 0)})            # stage 0 has 40 blocks of slices
    assert cold.prefill == r.prefill == "a0"
    assert (r.prefix_blocks, r.prefix_tokens, r.local_prefix_blocks) == (100, 1600, 0)
    assert r.fetch.source == "c" and (r.fetch.first_block, len(r.fetch.keys)) == (0, 100)
    assert r.fetch.keys == tuple(keys[:100]) and r.fetch.tokens == 1600
    # stage 1 fetches 100 half blocks: the slowest stage's share
    assert r.predicted_transfer_s == COST.transfer.seconds(100 * 8000)
    # the group computes only the uncached 400 tokens: far faster than cold
    gcost = PipelinedCostModel.of(COST, 2, 256, 2304)
    assert abs(r.predicted_prefill_s - gcost.prefill_s(400, 1600)) < 1e-9
    assert r.predicted_ttft_s < 0.3 * cold.predicted_ttft_s
    assert (cold.prefix_blocks, cold.fetch, cold.predicted_transfer_s) == (0, None, 0.0)
    # both stages hold every block themselves: no fetch, the whole prefix reused
    r = place_with_groups(None, groups, req, snap, COST, cfg, None, 0, queue_s, None,
                          {"a": (125, 125)})
    assert (r.prefix_blocks, r.fetch, r.predicted_transfer_s) == (125, None, 0.0)
