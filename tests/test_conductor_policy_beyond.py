"""Scheduling beyond Algorithm 1 (issue 17): fetch or recompute by predicted time,
shortest-prefill-first queues with an aging bound, KV-aware decode choice, cost-based
replication, the generated trace, the sweep's extra columns, and the live conductor
placing as the simulator does for the same snapshot. Pure decisions on hand-made
snapshots; the simulator runs are a few requests each."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from mooncaked.wire.messages import NodeReport, PlaceRequest
from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
from mooncaked.conductor.policy import (
                                        PlacementRequest,
                                        PolicyConfig,
                                        QueuedWork,
                                        Snapshot,
                                        choose_decode,
                                        pipeline_rescues,
                                        place,
                                        spf_bound_s,
                                        spf_pick,
                                        spf_wait_s,
                                        )
from mooncaked.conductor.replication import replication_worth
from mooncaked.conductor.service import ConductorService
from mooncaked.config import Settings
from mooncaked.sim.engine import SimConfig, Simulator, simulate
from mooncaked.sim.gen import GenConfig, generate
from mooncaked.sim.sweep import capacity_sweep
from mooncaked.sim.trace import TraceRequest

BS = 10
# prefill 10 ms a new token; decode 10 ms + 1 ms a sequence + 10 us a context token;
# transfer 1 ms a token (1000 bytes at 1 MB/s), no latency
COST = CostModel(prefill=PolyModel(((1, 0),), (0.01,)),
                 decode=PolyModel(((0, 0), (1, 0), (0, 1)), (0.01, 0.001, 1e-5)),
                 transfer=TransferModel(1e6, 0.0), kv_bytes_per_token=1000)
KEYS = tuple(range(10))                  # 100 tokens, 10 blocks
REQ = PlacementRequest(KEYS, 100, 10)


def cfg(policy: str = "cost_aware", **kw) -> PolicyConfig:
    return PolicyConfig(policy=policy, block_size=BS, **kw)


def test_policy_defaults_and_options():
    c = cfg()
    assert (c.fetch_rule, c.decode_rule, c.prefill_order) == ("cost", "kv_aware", "spf")
    g = cfg("global_cache_aware")
    assert (g.fetch_rule, g.decode_rule, g.prefill_order) == ("threshold", "step", "fcfs")
    assert cfg("global_cache_aware", fetch_rule="cost").fetch_rule == "cost"
    with pytest.raises(ValueError, match="fetch_rule"):
        cfg(fetch_rule="sometimes")
    with pytest.raises(ValueError, match="prefill_order"):
        cfg(prefill_order="lifo")
    with pytest.raises(ValueError, match="optional columns"):
        Snapshot(["a"], [0.0], [0], prefill_busy_s=[0.0, 1.0])


def _two_nodes(**kw) -> Snapshot:
    # a holds 6 blocks but is 5 s busy; b holds 4 and is idle
    return Snapshot(["a", "b"], [5.0, 0.0], [6, 4], **kw)


def test_cost_rule_fetches_where_the_ratio_threshold_would_not():
    # best/own = 6/4 = 1.5 is not above the threshold 1.5: Algorithm 1 recomputes on b
    g = place(REQ, _two_nodes(), COST, cfg("global_cache_aware"))
    assert (g.prefill, g.fetch, g.prefix_tokens) == ("b", None, 40)
    assert g.predicted_ttft_s == pytest.approx(0.6)              # 60 new tokens
    # by cost, fetching 20 tokens (0.02 s) to prefill 40 (0.4 s) beats 0.6 s
    c = place(REQ, _two_nodes(), COST, cfg(fetch_rule="cost", prefill_order="fcfs"))
    assert c.prefill == "b" and c.fetch.source == "a" and c.fetch.keys == (4, 5)
    assert (c.prefix_tokens, c.fetch.tokens) == (60, 20)
    assert c.predicted_ttft_s == pytest.approx(0.42)


def test_fixed_fetch_policies_always_and_never():
    """conductor.fetch_policy: the baselines of the fetch-or-recompute decision."""
    slow = dataclasses.replace(COST, transfer=TransferModel(10.0, 0.0))    # 10 B/s
    snap = Snapshot(["b"], [0.0], [0], holder_nodes=["c"], holder_prefix_blocks=[6])
    for rule in ("threshold", "cost"):
        kw = dict(fetch_rule=rule, prefill_order="fcfs")
        # adaptive: fetches over the fast link, recomputes over the slow one
        assert place(REQ, snap, COST, cfg("global_cache_aware", **kw)).fetch.source == "c"
        assert place(REQ, snap, slow, cfg("global_cache_aware", **kw)).fetch is None
        # always: fetches over the slow link too (the prediction counts the transfer)
        a = place(REQ, snap, slow, cfg("global_cache_aware", fetch_policy="always", **kw))
        assert (a.fetch.source, a.fetch.keys, a.prefix_tokens) == ("c", tuple(range(6)), 60)
        assert a.predicted_transfer_s == pytest.approx(slow.transfer_s(60))
        # never: recomputes over the fast link too
        nv = place(REQ, snap, COST, cfg("global_cache_aware", fetch_policy="never", **kw))
        assert (nv.fetch, nv.prefix_tokens) == (None, 0)
    # always ignores the ratio threshold: best/own = 6/4 = 1.5 fetches anyway
    g = place(REQ, Snapshot(["b"], [0.0], [4], holder_nodes=["c"], holder_prefix_blocks=[6]),
              COST, cfg("global_cache_aware", fetch_policy="always"))
    assert g.fetch.keys == (4, 5) and g.local_prefix_blocks == 4
    with pytest.raises(ValueError, match="fetch_policy"):
        cfg(fetch_policy="sometimes")


def test_cost_rule_counts_queueing_at_the_source_and_prefers_cache_nodes():
    busy = _two_nodes(prefill_busy_s=[1.0, 0.0])
    c = place(REQ, busy, COST, cfg(prefill_order="fcfs"))
    # 1 s of queued transfers at a: 1.02 + 0.4 > 0.6, so b recomputes
    assert (c.prefill, c.fetch) == ("b", None) and c.predicted_ttft_s == pytest.approx(0.6)
    # a cache node holding the whole prompt, idle: b fetches all 10 blocks from it
    snap = _two_nodes(prefill_busy_s=[1.0, 0.0], holder_nodes=["c"], holder_prefix_blocks=[10],
                      holder_busy_s=[0.0])
    c = place(REQ, snap, COST, cfg(prefill_order="fcfs"))
    assert c.fetch.source == "c" and c.prefix_blocks == 10
    assert c.predicted_ttft_s == pytest.approx(0.06)             # 60 tokens moved, nothing new
    # equally idle cache and prefill holders of the same prefix: the cache node is the source
    snap = _two_nodes(holder_nodes=["c"], holder_prefix_blocks=[6])
    assert place(REQ, snap, COST, cfg(prefill_order="fcfs")).fetch.source == "c"


def test_cost_rule_overlaps_the_fetch_with_the_queue_wait():
    snap = Snapshot(["b"], [2.0], [0], holder_nodes=["c"], holder_prefix_blocks=[10])
    t = place(REQ, snap, COST, cfg("global_cache_aware"))
    assert t.predicted_ttft_s == pytest.approx(2.1)              # transfer + queue + 0
    c = place(REQ, snap, COST, cfg(prefill_order="fcfs"))
    assert c.predicted_ttft_s == pytest.approx(2.0)              # max(queue, transfer) + 0
    assert c.predicted_transfer_s == pytest.approx(0.1)


def test_shortest_first_wait_and_pick():
    w = QueuedWork.of([3.0, 1.0, 2.0])
    assert w.total_s() == 6.0 and w.ahead(2.0) == (3.0, 1) and w.ahead(0.5) == (0.0, 3)
    assert spf_wait_s(10.0, [3.0, 1.0, 2.0], 2.0) == pytest.approx(4.0 + 3.0)
    waiting = [(0.0, 5.0), (1.0, 1.0), (2.0, 3.0)]           # (enqueued at, predicted s)
    assert spf_pick(waiting, 5.0, aging_s=10.0) == 1            # the shortest
    assert spf_pick(waiting, 10.5, aging_s=10.0) == 0           # the oldest waited 10 s
    assert spf_pick(waiting, 5.0, aging_s=0.0) == 0             # aging 0 is FCFS
    with pytest.raises(ValueError):
        spf_pick([], 0.0, 1.0)


def test_placement_counts_the_delay_it_causes_to_the_requests_it_overtakes():
    # a: 1 s running + a 9 s prefill queued; b: 1 s running + 0.5 s queued. The request
    # (1 s) would wait 1 s on a (overtaking the 9 s one) or 1.5 s on b (overtaking none).
    snap = Snapshot(["a", "b"], [10.0, 1.5], [0, 0], prefill_queued_s=[[9.0], [0.5]])
    fcfs = place(REQ, snap, COST, cfg(prefill_order="fcfs"))
    assert fcfs.prefill == "b" and fcfs.predicted_ttft_s == pytest.approx(2.5)
    spf = place(REQ, snap, COST, cfg())
    # own TTFT on a is 2.0 s but it delays the 9 s request by 1 s: score 3.0 > 2.5 on b
    assert spf.prefill == "b" and spf.predicted_queue_s == pytest.approx(1.5)
    snap = Snapshot(["a", "b"], [10.0, 3.0], [0, 0], prefill_queued_s=[[9.0], [2.0]])
    spf = place(REQ, snap, COST, cfg())
    assert spf.prefill == "a" and spf.predicted_ttft_s == pytest.approx(2.0)   # 3.0 < 4.0


def test_kv_aware_decode_keeps_room_for_the_next_request():
    # d1 is light but would be left with 40 tokens after this 110-token request; d2 busier
    snap = Snapshot(["p"], [0.0], [0], decode_nodes=["d1", "d2"], decode_batch=[1, 3],
                    decode_context_tokens=[100, 300], decode_free_kv_tokens=[150, 10_000])
    j, tbt, room = choose_decode(100, 10, snap, COST, "step")
    assert (j, room) == (0, True) and tbt == pytest.approx(COST.decode_step_s(2, 200))
    j, tbt, room = choose_decode(100, 10, snap, COST, "kv_aware")
    assert (j, room) == (1, True) and tbt == pytest.approx(COST.decode_step_s(4, 400))
    assert place(REQ, snap, COST, cfg()).decode == "d2"
    assert place(REQ, snap, COST, cfg("global_cache_aware")).decode == "d1"
    # when no node can keep that room, any node with room will do; none: the most free
    tight = Snapshot(["p"], [0.0], [0], decode_nodes=["d1", "d2"], decode_batch=[1, 0],
                     decode_context_tokens=[100, 0], decode_free_kv_tokens=[150, 120])
    assert choose_decode(100, 10, tight, COST, "kv_aware")[0] == 1
    full = Snapshot(["p"], [0.0], [0], decode_nodes=["d1", "d2"], decode_batch=[1, 0],
                    decode_context_tokens=[100, 0], decode_free_kv_tokens=[50, 100])
    assert choose_decode(100, 10, full, COST, "kv_aware")[1:] == (COST.decode_step_s(1, 100),
                                                                  False)
    with pytest.raises(ValueError):
        choose_decode(100, 10, snap, COST, "round_robin")


def test_replication_worth_weighs_observed_reuse_against_the_copy():
    # 1 use a second for 60 s, each saving 2 - 0.5 s, shared by 2 copies: 45 s > 0.5 s
    assert replication_worth(10, 10.0, 60.0, 2.0, 0.5, 1)
    # once in 10 minutes: 0.1 x 1.5 / 2 = 0.075 s < 0.5 s
    assert not replication_worth(1, 600.0, 60.0, 2.0, 0.5, 1)
    # more replicas share the uses: 8 uses in 8 s, 8 replicas: 60 x 1.5 / 9 = 10 s > 0.5 s
    assert replication_worth(8, 8.0, 60.0, 2.0, 0.5, 8)
    assert not replication_worth(8, 8.0, 60.0, 2.0, 20.0, 8)     # 10 s < a 20 s copy
    assert not replication_worth(100, 1.0, 60.0, 0.4, 0.5, 1)    # cheaper to recompute


def _service(policy: str) -> ConductorService:
    s = Settings()
    s.conductor.policy = policy
    s.conductor.ttft_slo_s = 100.0
    s.conductor.tbt_slo_s = 10.0
    s.engine.block_size = BS
    return ConductorService("c1", None, None, s, cost=COST)


def _report(svc, node, role, **kw):
    payload = {"node": node, "role": role, "pending": {}, "arrived": [],
               "decode": {"rids": [], "batch": 0, "context_tokens": 0, "free_kv_tokens": 10_000}}
    payload.update(kw)
    asyncio.run(svc.report(NodeReport.from_json(payload)))


def test_live_conductor_places_as_the_simulator_does_for_the_same_snapshot():
    from mooncaked.store.types import Inventory

    keys = [bytes([i]) * 16 for i in range(10)]
    svc = _service("cost_aware")
    for n in ("a", "b"):
        _report(svc, n, "prefill")
        svc.index.load_inventory(Inventory(n, 0, {}))
        svc.nodes[n].store_seq = 0
        svc.nodes[n].control = f"{n}.invalid:1"      # a fetch plan names the source's address
    _report(svc, "a", "prefill", pending={"x": [500, 0]}, store_seq=1, events=[
        {"kind": "stored", "tier": "dram", "seq": 1, "keys": [k.hex() for k in keys[:6]]}])
    _report(svc, "b", "prefill", store_seq=1, events=[
        {"kind": "stored", "tier": "dram", "seq": 1, "keys": [k.hex() for k in keys[:4]]}])
    _report(svc, "d1", "decode", decode={"rids": ["r"], "batch": 1, "context_tokens": 100,
                                         "free_kv_tokens": 150})
    _report(svc, "d2", "decode", decode={"rids": ["s", "t", "u"], "batch": 3,
                                         "context_tokens": 300, "free_kv_tokens": 10_000})
    req = PlaceRequest.from_json({"rid": "q", "keys": [k.hex() for k in keys],
                                  "prompt_tokens": 100, "max_new_tokens": 10})
    live = asyncio.run(svc.place(req)).to_json()
    # the simulator's call: the same snapshot, the PolicyConfig its SimConfig makes (nothing
    # waits in a queue here, so FCFS and spf predict the same wait)
    sim = Simulator([], SimConfig(policy="cost_aware", prefill_order="fcfs", block_tokens=BS,
                                  ttft_slo_s=100.0, tbt_slo_s=10.0), COST)
    snap = Snapshot(["a", "b"], [5.0, 0.0], [6, 4], ["d1", "d2"], [1, 3], [100, 300],
                    [150, 10_000], holder_nodes=[], holder_prefix_blocks=[])
    want = place(PlacementRequest(keys, 100, 10), snap, COST, sim.pcfg)
    assert (want.prefill, want.decode, want.fetch.source) == ("b", "d2", "a")
    assert live["prefill"]["node"] == want.prefill and live["decode"]["node"] == want.decode
    assert live["fetch"]["source"] == want.fetch.source
    assert [bytes.fromhex(k) for k in live["fetch"]["keys"]] == list(want.fetch.keys)
    assert live["predicted_ttft_s"] == pytest.approx(want.predicted_ttft_s)
    assert live["prefix_tokens"] == want.prefix_tokens == 60
    # and Algorithm 1 (the default policy) still places as before: b recomputes, d1 decodes
    svc.settings.conductor.policy = "global_cache_aware"
    req2 = PlaceRequest.from_json({"rid": "q2", "keys": [k.hex() for k in keys],
                                   "prompt_tokens": 100, "max_new_tokens": 10})
    old = asyncio.run(svc.place(req2)).to_json()
    assert old["prefill"]["node"] == "b" and old["fetch"] is None


def test_live_spf_queues_are_predicted_as_the_simulator_predicts_them():
    """cost_aware runs shortest-first prefill queues on both sides: the live conductor
    builds the queued column from the requests a node reports as waiting, and places
    as `place` does with the simulator's PolicyConfig and that snapshot."""
    svc = _service("cost_aware")
    _report(svc, "a", "prefill", pending={"x": [300, 0], "y": [900, 0]}, waiting=["y"])
    _report(svc, "b", "prefill", pending={"z": [1000, 0]})
    _report(svc, "d1", "decode")
    req = PlaceRequest.from_json({"rid": "q", "keys": [], "prompt_tokens": 100,
                                  "max_new_tokens": 10})
    live = asyncio.run(svc.place(req)).to_json()
    sim = Simulator([], SimConfig(policy="cost_aware", block_tokens=BS, ttft_slo_s=100.0,
                                  tbt_slo_s=10.0), COST)
    assert sim.pcfg.prefill_order == "spf"
    snap = Snapshot(["a", "b"], [12.0, 10.0], [0, 0], ["d1"], [0], [0], [10_000],
                    holder_nodes=[], holder_prefix_blocks=[], prefill_queued_s=[[9.0], []])
    want = place(PlacementRequest([], 100, 10), snap, COST, sim.pcfg)
    # a: x's 3 s then q's 1 s (q overtakes y); b: z's 10 s first
    assert (want.prefill, want.predicted_ttft_s) == ("a", pytest.approx(4.0))
    assert live["prefill"]["node"] == "a"
    # (x runs: the milliseconds since a's report come off its work)
    assert live["predicted_ttft_s"] == pytest.approx(want.predicted_ttft_s, abs=0.01)


def _ttfts(order: str, aging: float = 10.0) -> list[float]:
    # one prefill node: a 10k-token prompt runs, a 30k one and a 1k one queue behind it
    trace = [TraceRequest(0.0, 10_000, 2, (1,)), TraceRequest(0.01, 30_000, 2, (2,)),
             TraceRequest(0.02, 1_000, 2, (3,))]
    r = simulate(trace, SimConfig(policy="cost_aware", prefill=1, decode=1, block_tokens=512,
                                  prefill_order=order, aging_s=aging))
    return list(r.ttft_s)


def test_simulated_shortest_first_queue_runs_the_short_prompt_first_within_the_bound():
    fcfs, spf = _ttfts("fcfs"), _ttfts("spf")
    assert spf[2] < fcfs[2] and spf[1] > fcfs[1]          # the short one overtakes
    assert sum(spf) < sum(fcfs)
    assert _ttfts("spf", aging=0.0) == fcfs                 # aging 0: FCFS again


def test_generated_trace_is_deterministic_and_reuses_prefixes():
    c = GenConfig(seed=3, duration_s=120.0, session_rate_rps=0.5, system_prompts=5)
    a, b = generate(c), generate(c)
    assert a == b and len(a) > 20
    assert generate(GenConfig(seed=4, duration_s=120.0, session_rate_rps=0.5,
                              system_prompts=5)) != a
    ts = [r["timestamp"] for r in a]
    assert ts == sorted(ts) and ts[0] == 0
    for r in a:
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 512)
    # some later request extends an earlier one's full blocks (a next turn)
    full = [tuple(r["hash_ids"][:r["input_length"] // 512]) for r in a]
    assert any(len(y) > len(x) > 0 and y[:len(x)] == x for i, x in enumerate(full)
               for y in full[i + 1:])


def test_sweep_reports_ttft_and_hit_rate_at_the_trace_rate():
    recs = generate(GenConfig(seed=1, duration_s=60.0, session_rate_rps=0.5, system_prompts=5))
    trace = [TraceRequest(r["timestamp"] / 1000, r["input_length"], r["output_length"],
                          tuple(r["hash_ids"])) for r in recs]
    base = SimConfig(prefill=2, decode=1, cache_tokens=1e6)
    out = capacity_sweep(trace, base, ["global_cache_aware", "cost_aware"], (0.1,),
                         bisections=1, max_mult=4.0)
    for p in ("global_cache_aware", "cost_aware"):
        r = out["at_trace_rate"][p]
        assert r["ttft_max_s"] >= r["ttft_p90_s"] > 0 and 0 <= r["cache_hit_rate"] <= 1
        assert out["at_baseline_capacity"][p]["arrival_rate_rps"] == pytest.approx(
            out["results"]["global_cache_aware"]["0.1"]["arrival_rate_rps"])


def test_waiting_for_a_prefix_still_being_computed():
    # a runs a prefill that will store all 10 blocks of this request within 0.5 s
    snap = Snapshot(["a", "b"], [0.5, 0.0], [0, 0], pending_prefix_blocks=[10, 0],
                    pending_ready_s=[0.5, 0.0])
    c = place(REQ, snap, COST, cfg(prefill_order="fcfs"))
    assert c.prefill == "a" and c.waits_for_pending and c.prefix_blocks == 10
    assert c.predicted_ttft_s == pytest.approx(0.5)             # wait, then nothing new
    late = Snapshot(["a", "b"], [0.5, 0.0], [0, 0], pending_prefix_blocks=[10, 0],
                    pending_ready_s=[1.5, 0.0])
    c = place(REQ, late, COST, cfg(prefill_order="fcfs"))
    assert c.prefill == "b" and not c.waits_for_pending        # recomputing (1.0 s) is sooner
    assert place(REQ, snap, COST, cfg("global_cache_aware")).prefill == "b"


def test_simulated_next_turn_reuses_the_prefix_its_previous_turn_is_computing():
    # the second request extends the first, arriving while the first is still prefilling
    first = TraceRequest(0.0, 40 * 512, 1, tuple(range(40)))
    nxt = TraceRequest(0.1, 41 * 512, 1, tuple(range(41)))
    hits = {p: simulate([first, nxt], SimConfig(policy=p, prefill=2, decode=0, output_tokens=1))
            .summary["cache_hit_rate"] for p in ("global_cache_aware", "cost_aware")}
    assert hits["global_cache_aware"] == 0.0                    # not stored yet: recomputed
    assert hits["cost_aware"] == pytest.approx(40 / (40 + 41))  # waited for it on its node


# ---- elastic chunked pipeline parallelism (PolicyConfig.pipeline_stages)

LONG = PlacementRequest(tuple(range(200)), 2000, 10)     # 2000 tokens: 20 s on one node
# chunks of 500 tokens (5 s of prefill each), no hidden-state hop: on k stages a chunk takes
# 5/k s a stage; latency = 20/k + (k - 1) * 5/k, occupancy 20/k


def pcfg(policy: str = "cost_aware", **kw) -> PolicyConfig:
    return cfg(policy, pipeline_chunk_tokens=500, pipeline_hidden_bytes_per_token=0, **kw)


def test_pipelines_a_long_prompt_over_idle_nodes_when_predicted_faster():
    snap = Snapshot(["a", "b", "c"], [0.0] * 3, [0] * 3, prefill_free_s=[0.0] * 3)
    c = place(LONG, snap, COST, pcfg())                          # cost_aware: up to 2 stages
    assert c.prefill == "a" and c.helpers == ("b",)
    assert c.predicted_ttft_s == pytest.approx(12.5) and c.pipeline.occupancy_s == pytest.approx(10)
    c3 = place(LONG, snap, COST, pcfg(pipeline_stages=4))        # only 3 nodes: 3 stages
    assert c3.helpers == ("b", "c") and c3.predicted_ttft_s == pytest.approx(20 / 3 + 2 * 5 / 3)
    # Algorithm 1 keeps single nodes; so does a cluster that reports no free times (live)
    for c1 in (place(LONG, snap, COST, pcfg("global_cache_aware")),
               place(LONG, Snapshot(["a", "b", "c"], [0.0] * 3, [0] * 3), COST, pcfg())):
        assert c1.helpers == () and c1.pipeline is None and c1.predicted_ttft_s == pytest.approx(20)
    short = PlacementRequest(tuple(range(90)), 900, 10)         # under pipeline_min_tokens
    assert place(short, snap, COST, pcfg()).helpers == ()
    # a helper still running 3 s: stage 1 joins one step (2.5 s) after stage 0 starts,
    # so stage 0 starts at 0.5 s
    busy = Snapshot(["a", "b"], [0.0, 3.0], [0, 0], prefill_free_s=[0.0, 3.0])
    c = place(LONG, busy, COST, pcfg())
    assert c.helpers == ("b",) and c.predicted_queue_s == pytest.approx(0.5)
    assert c.predicted_ttft_s == pytest.approx(13.0)


def test_pipeline_pays_for_the_node_time_it_holds_when_others_queue():
    # gain 20 - 12.5 = 7.5 s; the 2-stage bubble holds 2.5 node-seconds, charged once per
    # node with requests queued (free time inf): 2 such nodes still pipeline, 4 do not
    # (the score alone: the under-load rule off)
    off = pcfg(pipeline_under_load_ttft_s=0.0)
    assert place(LONG, _queued_snap(2), COST, off).helpers == ("b",)
    c = place(LONG, _queued_snap(4), COST, off)
    assert c.helpers == () and c.predicted_ttft_s == pytest.approx(20)


def _queued_snap(queued: int) -> Snapshot:
    # a and b idle, `queued` more nodes with requests queued
    n = 2 + queued
    return Snapshot(list("abcdef")[:n], [0.0, 0.0] + [100.0] * queued, [0] * n,
                    prefill_free_s=[0.0, 0.0] + [math.inf] * queued)


def test_under_load_a_pipeline_must_turn_a_ttft_miss_into_a_hit():
    # LONG: 20 s on one node, 12.5 s over a and b (both idle); c and d have requests queued
    assert pipeline_rescues(0, 20.0, 12.5, 30.0) and pipeline_rescues(2, 20.0, 12.5, 0.0)
    assert not pipeline_rescues(2, 20.0, 12.5, 30.0)          # meets 30 s on one node
    assert pipeline_rescues(2, 20.0, 12.5, 15.0)              # misses 15 s alone, meets it
    assert not pipeline_rescues(2, 20.0, 12.5, 10.0)          # misses 10 s either way
    assert not pipeline_rescues(2, 20.0, 12.5, math.inf)      # never under load
    assert pcfg().pipeline_under_load_ttft_s == 30.0
    with pytest.raises(ValueError):
        pcfg(pipeline_under_load_ttft_s=-1.0)
    # place(): nothing queued, the default pipelines; queued, only the rescue does
    assert place(LONG, _queued_snap(0), COST, pcfg()).helpers == ("b",)
    c = place(LONG, _queued_snap(2), COST, pcfg())
    assert c.helpers == () and c.predicted_ttft_s == pytest.approx(20)
    c = place(LONG, _queued_snap(2), COST, pcfg(pipeline_under_load_ttft_s=15.0))
    assert c.helpers == ("b",) and c.predicted_ttft_s == pytest.approx(12.5)
    for slo in (10.0, math.inf):
        assert place(LONG, _queued_snap(2), COST, pcfg(pipeline_under_load_ttft_s=slo)).helpers == ()


def test_simulated_pipeline_holds_its_stage_nodes():
    # 2048 tokens, chunks of 512: 2.56 s a chunk-stage; latency 12.8 s, stage 0 free at
    # 10.24 s, stage 1 at 12.8 s. The next request (1024 tokens: 10.24 s alone, 7.68 s
    # pipelined) arrives at 1 s; stage 1 of its pipeline joins 2.56 s after stage 0, so
    # both start as the first pipeline ends: at 10.24 s on a, 12.8 s on b.
    trace = [TraceRequest(0.0, 2048, 1, (0, 1, 2, 3)), TraceRequest(1.0, 1024, 1, (7, 8))]
    def run(policy: str) -> tuple[list[float], int]:
        sim = Simulator(trace, SimConfig(policy=policy, prefill=2, decode=0, output_tokens=1,
                                         cpp_chunk_tokens=512, cpp_hidden_bytes_per_token=0),
                        COST)
        res = sim.run()
        return [q.first - q.arrival for q in sorted(sim.served, key=lambda q: q.i)], \
            res.summary["pipelined"]
    ttft, n = run("cost_aware")
    assert n == 2 and ttft == pytest.approx([12.8, 10.24 - 1 + 7.68])
    ttft, n = run("global_cache_aware")
    assert n == 0 and ttft == pytest.approx([20.48, 10.24])
    with pytest.raises(ValueError, match="elastic"):
        SimConfig(prefill=4, cpp=2, pipeline_stages=2)


def test_spf_adaptive_starvation_bound():
    # the bound is aging_s, or the FCFS wait seen on arrival plus the slack if sooner
    assert spf_bound_s(30.0, 4.0, 10.0) == 14.0 and spf_bound_s(30.0, 25.0, 10.0) == 30.0
    assert cfg().fcfs_slack_s == 10.0 and cfg("global_cache_aware").fcfs_slack_s == math.inf
    # (enqueued at, predicted s, own bound): the long one waited 15 >= 14 s, so it goes first
    waiting = [(0.0, 40.0, spf_bound_s(30.0, 4.0, 10.0)), (5.0, 1.0, 30.0)]
    assert spf_pick(waiting, 15.0, 30.0) == 0 and spf_pick(waiting, 13.0, 30.0) == 1


def test_spf_slack_follows_the_fcfs_wait():
    """fcfs_slack_ratio: the slack is at most ratio x the FCFS wait seen on arrival, so a
    lightly queued node keeps a request close to its FCFS start (cost_aware: ratio 1)."""
    assert spf_bound_s(30.0, 4.0, 10.0, 1.0) == 8.0        # 4 s wait + min(10, 4)
    assert spf_bound_s(30.0, 12.0, 10.0, 1.0) == 22.0      # the fixed slack caps it
    assert spf_bound_s(30.0, 25.0, 10.0, 1.0) == 30.0      # the aging bound caps it
    assert spf_bound_s(30.0, 0.0, 10.0, 1.0) == 0.0        # an idle node: FCFS
    assert spf_bound_s(30.0, 4.0, 10.0) == 14.0            # no ratio: the fixed slack
    assert spf_bound_s(30.0, 0.0, 10.0) == 10.0
    assert cfg().fcfs_slack_ratio == 1.0
    # cost_aware's bound is relative to FCFS alone; the other policies keep the 30 s aging
    assert cfg().aging_s == math.inf and cfg("global_cache_aware").aging_s == 30.0
    assert cfg(aging_s=20.0).aging_s == 20.0
    assert cfg("global_cache_aware").fcfs_slack_ratio == math.inf
    assert cfg(fcfs_slack_ratio=2.0).fcfs_slack_ratio == 2.0
    with pytest.raises(ValueError, match="fcfs_slack_ratio"):
        cfg(fcfs_slack_ratio=-1.0)


def test_spf_bound_on_the_start_time():
    """spf_bound_rule "start": a shorter prefill runs only if it ends before every waiting
    request's bound runs out; "wait" lets it run and the bound be overrun by its length."""
    # L: enqueued at 1, 20 s, bound 18 s (starts by 19); S: enqueued at 3, 5 s, bound 30 s
    waiting = [(1.0, 20.0, 18.0), (3.0, 5.0, 30.0)]
    assert spf_pick(waiting, 10.0, 30.0, bound_on_start=True) == 1    # S ends at 15 < 19
    assert spf_pick(waiting, 15.0, 30.0, bound_on_start=True) == 0    # S would end at 20
    assert spf_pick(waiting, 15.0, 30.0) == 1                         # "wait": S first
    assert spf_pick(waiting, 19.0, 30.0) == 0                         # L waited its 18 s
    # the oldest of those it would push past their bound goes first
    three = [(0.0, 9.0, 12.0), (1.0, 8.0, 11.0), (2.0, 4.0, 30.0)]
    assert spf_pick(three, 9.0, 30.0, bound_on_start=True) == 0
    assert spf_pick(three, 7.0, 30.0, bound_on_start=True) == 2       # 11 < 12 and 12
    assert cfg().spf_bound_rule == "start" and cfg("global_cache_aware").spf_bound_rule == "wait"
    assert cfg(spf_bound_rule="wait").spf_bound_rule == "wait"
    with pytest.raises(ValueError, match="spf_bound_rule"):
        cfg(spf_bound_rule="deadline")


def _order_sim(rule: str) -> list[int]:
    # one prefill node (10 ms a token): R0 10 s at 0; L 20 s at 1 (FCFS wait 9 s, bound
    # 9 + min(10, 9) = 18 s); S1, S2 5 s at 2 and 3
    trace = [TraceRequest(0.0, 1000, 2, (1,)), TraceRequest(1.0, 2000, 2, (2,)),
             TraceRequest(2.0, 500, 2, (3,)), TraceRequest(3.0, 500, 2, (4,))]
    sim = Simulator(trace, SimConfig(policy="cost_aware", prefill=1, decode=1,
                                     block_tokens=BS, spf_bound_rule=rule), COST)
    sim.run()
    return [q.i for q in sorted(sim.served, key=lambda q: q.pf_start)]


def test_live_prefill_queue_runs_the_order_the_simulator_runs():
    """The same four prefills through the simulator's queue and through a live node's
    PrefillQueue (cost_aware's defaults: no aging bound, slack 10 s, ratio 1, bound on the
    start) start in
    the same order; with the bound on the wait, L's bound is overrun by S2's 5 s."""
    from mooncaked.cluster.prefill_queue import (
                                                 PrefillQueue,
                                                 resolve_aging,
                                                 resolve_bound_rule,
                                                 resolve_fcfs_slack,
                                                 resolve_fcfs_slack_ratio,
                                                 )

    async def live(rule: str) -> list[int]:
        t = [0.0]
        q = PrefillQueue("spf", resolve_aging("cost_aware", -1.0),
                         resolve_fcfs_slack("cost_aware", -1.0), lambda: t[0],
                         fcfs_slack_ratio=resolve_fcfs_slack_ratio("cost_aware", -1.0),
                         bound_rule=resolve_bound_rule("cost_aware", rule))
        preds = {1: 20.0, 2: 5.0, 3: 5.0}
        done = {i: asyncio.Event() for i in preds}
        ran: list[int] = []
        assert await q.acquire(10.0)                          # R0 runs 0..10
        ran.append(0)

        async def one(i: int) -> None:
            async with q.turn(preds[i]):
                ran.append(i)
                await done[i].wait()                          # its prefill runs
        tasks = []
        for i, at in ((1, 1.0), (2, 2.0), (3, 3.0)):
            t[0] = at
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0)
        t[0] = 10.0
        q.release()
        for _ in preds:                                       # each ends after its prefill
            while not (len(ran) > 1 and not done[ran[-1]].is_set()):
                await asyncio.sleep(0)
            t[0] += preds[ran[-1]]
            done[ran[-1]].set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return ran

    assert resolve_bound_rule("cost_aware", "") == "start"
    assert _order_sim("") == asyncio.run(live("")) == [0, 2, 1, 3]
    assert _order_sim("wait") == asyncio.run(live("wait")) == [0, 2, 3, 1]
