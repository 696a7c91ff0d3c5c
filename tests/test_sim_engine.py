"""The cluster simulator: hand-computed timelines, the trace's hit rate, ordering on the real trace."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from mooncaked.conductor.cost_model import DECODE_TERMS, PREFILL_TERMS, CostModel, PolyModel, TransferModel
from mooncaked.sim.cache import LRUCache
from mooncaked.sim.engine import SimConfig, simulate
from mooncaked.sim.hitrate import sequential_hit_rate
from mooncaked.sim.sweep import capacity_sweep
from mooncaked.sim.trace import TraceRequest, load_trace

# Prefill 1 ms a new token, decode 10 ms a step whatever the batch, transfer 1 us a token.
FLAT = CostModel(prefill=PolyModel(PREFILL_TERMS, (0.0, 1e-3, 0.0, 0.0, 0.0)),
                 decode=PolyModel(DECODE_TERMS, (0.01, 0.0, 0.0)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000)


def flat(policy="global_cache_aware", **kw):
    return SimConfig(policy=policy, prefill=kw.pop("prefill", 1), decode=kw.pop("decode", 1),
                     replica_ranks=(), **kw)


def test_one_request_timeline():
    r = simulate([TraceRequest(0.0, 512, 11, (1,))], flat(), FLAT)
    s = r.summary
    assert s["completed"] == 1 and s["rejected"] == 0
    assert s["ttft_mean_s"] == pytest.approx(0.512)            # 512 tokens at 1 ms
    assert r.tbt_s[0] == pytest.approx(0.01)                    # 10 decode steps of 10 ms
    assert s["makespan_s"] == pytest.approx(0.612)
    assert s["prefill_compute_s_per_request"] == pytest.approx(0.512)


def test_join_at_step_boundary_and_prefix_hit():
    trace = [TraceRequest(0.0, 512, 101, (1,)),       # decodes 0.512 .. 1.512
             TraceRequest(0.605, 512, 11, (2,)),      # first token 1.117, joins at 1.122
             TraceRequest(2.0, 1024, 1, (1, 3))]      # reuses block 1: prefills 512 tokens
    r = simulate(trace, flat(), FLAT)
    assert list(r.ttft_s) == pytest.approx([0.512, 0.512, 0.512])
    assert r.tbt_s[1] == pytest.approx(0.015)                   # 1.117 -> 1.132
    assert r.tbt_s[0] == pytest.approx(0.01)
    assert r.summary["cache_hit_rate"] == pytest.approx(512 / 2048)
    assert r.summary["makespan_s"] == pytest.approx(2.512)


def test_coupled_prefill_stalls_running_decodes():
    trace = [TraceRequest(0.0, 512, 101, (1,)), TraceRequest(0.6055, 512, 2, (2,))]
    r = simulate(trace, flat("coupled", decode=0), FLAT)
    # B's prefill runs 0.612 .. 1.124; A's gap across it is 0.522 s, its other 99 are 10 ms.
    assert list(r.ttft_s) == pytest.approx([0.512, 0.5185])
    assert r.tbt_s[0] == pytest.approx((0.522 + 9 * 0.01) / 10)
    dis = simulate(trace, flat(), FLAT)
    assert dis.tbt_s[0] == pytest.approx(0.01)                  # disaggregated: no stall


def test_decode_kv_room_queues_requests():
    trace = [TraceRequest(0.0, 500, 11, (1,)), TraceRequest(0.0, 500, 11, (2,))]
    r = simulate(trace, flat(decode_kv_tokens=600), FLAT)
    # Second request's prefill ends at 1.0; it waits for the first to finish decoding (0.6).
    assert r.summary["completed"] == 2 and max(r.tbt_s) == pytest.approx(0.01)
    r = simulate([TraceRequest(0.0, 500, 111, (1,)), TraceRequest(0.0, 500, 11, (2,))],
                 flat(decode_kv_tokens=700), FLAT)
    # The second lands at 1.0 but waits until the first finishes at 0.5 + 1.1 = 1.6.
    assert r.tbt_s[1] == pytest.approx(0.61)
    assert r.summary["makespan_s"] == pytest.approx(1.7)


def test_lru_cache_keeps_prefix_heads():
    c = LRUCache(3 * 512, 512)
    assert c.insert([1, 2]) == ([2, 1], [])
    new, evicted = c.insert([7, 8, 9])
    assert new == [9, 8, 7] and set(evicted) == {1, 2}
    assert c.match([7, 8, 9]) == 3
    new, evicted = c.insert([1, 2, 3, 4])     # larger than the cache: its tail goes first
    assert evicted == [9, 8, 7, 4] and c.match([1, 2, 3, 4]) == 3


def test_trace_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 5, "input_length": 10}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a Mooncake trace record"):
        load_trace(p)
    assert load_trace(p, limit=1)[0] == TraceRequest(0.0, 10, 1, (1,))


def test_unbounded_hit_rate_is_0_374(shared_trace):
    trace = load_trace(shared_trace)
    assert len(trace) == 12031
    assert round(sequential_hit_rate(trace), 3) == 0.374
    assert sequential_hit_rate(trace, 3e6) < 0.374 / 2          # Figure 9: 3M is under half


def test_policy_ordering_on_the_conversation_trace(shared_trace):
    trace = load_trace(shared_trace, limit=2000)
    res = {p: simulate(trace, SimConfig(policy=p, prefill=10, decode=6, cache_tokens=3e6)).summary
           for p in ("random", "load_balancing", "local_cache_aware", "global_cache_aware",
                     "coupled")}
    for s in res.values():
        for k in ("requests", "cache_hit_rate", "ttft_mean_s", "ttft_p90_s", "tbt_mean_s",
                  "rejected", "effective_request_capacity", "prefill_compute_s_per_request"):
            assert isinstance(s[k], (int, float)) and not math.isnan(s[k]), k
        assert s["requests"] == s["completed"] + s["rejected"] == 2000
    ttft = {p: s["ttft_mean_s"] for p, s in res.items()}
    assert ttft["random"] > ttft["load_balancing"] > ttft["local_cache_aware"] > ttft["global_cache_aware"]
    g, loc = res["global_cache_aware"], res["local_cache_aware"]
    assert g["cache_hit_rate"] > loc["cache_hit_rate"] > res["load_balancing"]["cache_hit_rate"]
    assert g["fetches"] > 0 and loc["fetches"] == 0
    assert g["prefill_compute_s_per_request"] < res["load_balancing"]["prefill_compute_s_per_request"]
    assert res["coupled"]["tbt_mean_s"] > 3 * g["tbt_mean_s"]
    assert g["effective_request_capacity"] > res["coupled"]["effective_request_capacity"]


def test_sweep_finds_a_higher_capacity_for_disaggregation(shared_trace):
    trace = load_trace(shared_trace, limit=400)
    out = capacity_sweep(trace, SimConfig(prefill=10, decode=6, cache_tokens=3e6, replica_ranks=()),
                         ["coupled", "global_cache_aware"], [0.1], target=0.9, bisections=3,
                         scan_points=4)
    c = out["results"]["coupled"]["0.1"]
    g = out["results"]["global_cache_aware"]["0.1"]
    assert g["effective_request_capacity"] >= 0.9 and c["effective_request_capacity"] >= 0.9
    assert g["arrival_rate_rps"] > c["arrival_rate_rps"] > 0
    assert out["ratio_vs_coupled"]["global_cache_aware"]["0.1"] > 1
    assert g["highest_passing_rps"] >= g["arrival_rate_rps"] and g["highest_passing_share"] >= 0.9
    assert 0 < g["conservative_rps"] <= g["highest_passing_rps"]


def _mooncake(*args):
    return subprocess.run([sys.executable, "-c", "from mooncaked.cli.main import main; main()",
                           *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, MPLBACKEND="Agg"))


def test_cli_json(tmp_path, shared_trace):
    cost = tmp_path / "cost.json"
    dataclasses.replace(FLAT, name="flat test model").save(cost)
    out = _mooncake("sim", shared_trace, "--policy", "global_cache_aware", "--prefill", "4",
                    "--decode", "2", "--cache-tokens", "3M", "--time-scale", "0.5",
                    "--limit", "300", "--json", "--plot-dir", tmp_path, "--cost-model", cost)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["requests"] == 300 and s["config"]["cache_tokens"] == 3e6
    assert s["cost_model"] == "flat test model"
    assert 0 < s["cache_hit_rate"] < 1 and s["ttft_p90_s"] >= s["ttft_p50_s"]
    assert (tmp_path / "ttft_tbt_cdf.png").stat().st_size > 10_000
    assert (tmp_path / "replicas_global_cache_aware.png").exists()
    bad = _mooncake("sim", shared_trace, "--policy", "fastest")
    assert bad.returncode != 0 and "unknown policy" in bad.stderr
    curve = _mooncake("sim", shared_trace, "--policy", "global_cache_aware", "--limit", "300",
                      "--output-tokens", "1", "--hit-curve", "100k,inf", "--json")
    assert curve.returncode == 0, curve.stderr
    c = json.loads(curve.stdout)
    assert c["capacities_tokens"] == [1e5, "inf"]
    small, unbounded = c["sequential_hit_rate"]
    assert small <= unbounded == c["unbounded_hit_rate"]
    assert 0 < c["simulated_hit_rate"]["global_cache_aware"][1] <= unbounded
