"""CPP group timing (conductor/cpp_cost.py) and `mooncake sim --cpp` (sim/engine.py)."""

from __future__ import annotations

import pytest

from mooncaked.conductor.cost_model import (
    DECODE_TERMS,
    PREFILL_TERMS,
    CostModel,
    PolyModel,
    TransferModel,
)
from mooncaked.conductor.cpp_cost import PipelinedCostModel, pipeline_timing
from mooncaked.sim.engine import SimConfig, simulate
from mooncaked.sim.trace import TraceRequest

# Prefill 1 ms a new token (no context term), transfer 1 GB/s, hidden 1000 bytes a token.
FLAT = CostModel(prefill=PolyModel(PREFILL_TERMS, (0.0, 1e-3, 0.0, 0.0, 0.0)),
                 decode=PolyModel(DECODE_TERMS, (0.01, 0.0, 0.0)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000)


def test_pipeline_timing_fill_and_drain():
    # 8 chunks of 512 on 2 stages: each chunk 0.256 s a stage; latency = 8 x 0.256 + bubble
    # (one chunk's stage time + one hop of 512 x 1000 bytes at 1 GB/s).
    t = pipeline_timing(FLAT, 4096, 0, stages=2, chunk_tokens=512, hidden_bytes_per_token=1000)
    assert t.chunks == 8
    assert t.occupancy_s == pytest.approx(2.048)
    assert t.latency_s == pytest.approx(2.048 + 0.256 + 512e-6)
    # One chunk gains nothing; one stage is the single node.
    one = pipeline_timing(FLAT, 300, 0, stages=2, chunk_tokens=512, hidden_bytes_per_token=0)
    assert one.latency_s == pytest.approx(0.3) and one.occupancy_s == pytest.approx(0.15)
    assert pipeline_timing(FLAT, 4096, 0, 1, 512, 1000).latency_s == pytest.approx(FLAT.prefill_s(4096, 0))
    assert pipeline_timing(FLAT, 0, 10, 2, 512, 1000).latency_s == 0.0
    with pytest.raises(ValueError):
        pipeline_timing(FLAT, 10, 0, 0, 512, 1000)
    p = PipelinedCostModel.of(FLAT, 2, 512, 1000)
    assert p.prefill_s(4096, 0) == pytest.approx(t.latency_s)
    assert p.decode_step_s(4, 100) == FLAT.decode_step_s(4, 100)


def test_sim_cpp_groups_cut_long_prompt_ttft_and_keep_throughput():
    # Two 8k-token prompts at once on 2 prefill nodes: alone each takes 8.192 s. As one
    # 2-stage group, the first finishes in about half that, and the second enters as soon
    # as stage 0 is free, so it is not delayed by the whole first prefill.
    trace = [TraceRequest(0.0, 8192, 1, (1,)), TraceRequest(0.0, 8192, 1, (2,))]
    base = {"policy": "load_balancing", "prefill": 2, "decode": 1, "output_tokens": 1, "replica_ranks": ()}
    single = simulate(trace, SimConfig(**base), FLAT).summary
    r = simulate(trace, SimConfig(**base, cpp=2, cpp_chunk_tokens=512, cpp_hidden_bytes_per_token=1000),
                 FLAT)
    cpp = r.summary
    assert single["ttft_mean_s"] == pytest.approx(8.192)
    first = 4.096 + 0.256 + 512e-6  # 16 chunks x 0.256 s a stage, then the drain
    assert sorted(r.ttft_s) == pytest.approx([first, 4.096 + first])
    assert cpp["prefill_compute_s_per_request"] == pytest.approx(8.192)
    with pytest.raises(ValueError, match="cpp must divide"):
        SimConfig(**{**base, "prefill": 3}, cpp=2)


def test_choose_group_by_threshold_and_predicted_ttft():
    from mooncaked.conductor.cpp_cost import choose_group

    t = pipeline_timing(FLAT, 4096, 0, 2, 512, 1000)               # about 2.3 s
    assert choose_group(4096, 4.096, 0.0, t).use_group
    assert not choose_group(4096, 4.096, 2.0, t).use_group          # its queue makes it slower
    short = pipeline_timing(FLAT, 600, 0, 2, 512, 1000)
    c = choose_group(600, 0.6, 0.0, short, cpp_min_tokens=1000)
    assert not c.use_group and "600 < 1000" in c.reason
