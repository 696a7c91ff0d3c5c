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


def _schedule(per_stage, hop):
    """Reference: the pipeline's finish time chunk by chunk (chunk i leaves stage k-1,
    crosses one hop, waits for stage k to finish chunk i-1)."""
    done = [0.0] * len(per_stage[0])
    for k, st in enumerate(per_stage):
        t = 0.0
        for i, s in enumerate(st):
            t = max(done[i] + (hop if k else 0.0), t) + s
            done[i] = t
    return done[-1]


def test_stage_timing_slowest_stage_dominates_and_the_others_add_their_chunk():
    from mooncaked.conductor.cpp_cost import chunk_stage_seconds, stage_timing

    # 1100 tokens in chunks of 512 on 2 stages at 1 ms a token: 0.256, 0.256, 0.038 s
    assert chunk_stage_seconds(FLAT, 1100, 0, 2, 512) == pytest.approx((0.256, 0.256, 0.038))
    assert chunk_stage_seconds(FLAT, 0, 0, 2, 512) == ()
    # stage 1 twice as slow: its 6 s dominate, stage 0 adds its first chunk (the fill)
    t = stage_timing([(1.0, 1.0, 1.0), (2.0, 2.0, 2.0)], 0.1)
    assert (t.latency_s, t.occupancy_s, t.chunks) == (pytest.approx(7.1), 6.0, 3)
    # a slow middle stage: stage 0 fills (1 s), stage 2 drains (its largest chunk, 2 s)
    t = stage_timing([(1.0, 1.0), (3.0, 3.0), (2.0, 2.0)], 0.0)
    assert t.latency_s == pytest.approx(6.0 + 1.0 + 2.0) and t.occupancy_s == 6.0
    # equal chunk times: exactly the chunk-by-chunk schedule, whichever stage is slowest
    for f in ((1.0, 1.0), (1.0, 2.5), (3.0, 1.0), (1.0, 4.0, 2.0)):
        per = [tuple(x * 0.3 for _ in range(5)) for x in f]
        assert stage_timing(per, 0.01).latency_s == pytest.approx(_schedule(per, 0.01))
    assert stage_timing([(), ()], 1.0).latency_s == 0.0
    with pytest.raises(ValueError, match="same chunk count"):
        stage_timing([(1.0,), (1.0, 1.0)], 0.0)


def test_pipelined_cost_model_uses_learned_stage_factors():
    base = PipelinedCostModel.of(FLAT, 2, 512, 1000)
    same = PipelinedCostModel.of(FLAT, 2, 512, 1000, stage_factors=(1.0, 1.0))
    for n in (4096, 1100, 300):                                # factors 1: the plain formula
        assert same.prefill_s(n, 0) == pytest.approx(base.prefill_s(n, 0))
        assert same.timing(n, 0).occupancy_s == pytest.approx(base.timing(n, 0).occupancy_s)
    # stage 1 measured 2x its share: 8 chunks x 0.512 s on it, stage 0's 0.256 s of fill, one hop
    slow = PipelinedCostModel.of(FLAT, 2, 512, 1000, stage_factors=(1.0, 2.0))
    assert slow.prefill_s(4096, 0) == pytest.approx(4.096 + 0.256 + 512e-6)
    assert slow.timing(4096, 0).occupancy_s == pytest.approx(4.096)
    # the overhead scale multiplies the learned pipeline
    assert PipelinedCostModel.of(FLAT, 2, 512, 1000, 1.5, (1.0, 2.0)).prefill_s(4096, 0) == \
        pytest.approx(1.5 * slow.prefill_s(4096, 0))
    for bad in ((1.0,), (1.0, 0.0)):
        with pytest.raises(ValueError, match="stage_factors"):
            PipelinedCostModel.of(FLAT, 2, 512, 1000, stage_factors=bad)
