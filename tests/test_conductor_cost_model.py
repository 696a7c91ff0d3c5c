"""Cost models: least-squares fit, JSON round trip, and the paper's setting."""

import json
import math

import numpy as np
import pytest

from mooncaked.conductor.cost_model import (DECODE_TERMS, PREFILL_TERMS, CostModel, PaperSetting,
                                            PolyModel, TransferModel, fit_cost_model,
                                            paper_cost_model)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true_p = (0.02, 3e-5, 1e-6, 2e-10, 4e-10)        # const, x, c, x^2, x*c
    true_d = (0.015, 1.1e-4, 2.9e-8)                  # const, batch, context
    pm = PolyModel(PREFILL_TERMS, true_p)
    dm = PolyModel(DECODE_TERMS, true_d)
    new = rng.integers(1, 100_000, 200)
    cached = rng.integers(0, 100_000, 200)
    ps = [(x, c, pm(x, c) * (1 + rng.normal(0, 1e-3))) for x, c in zip(new, cached)]
    batch = rng.integers(1, 256, 100)
    ctx = rng.integers(1000, 1_000_000, 100)
    ds = [(b, t, dm(b, t)) for b, t in zip(batch, ctx)]
    m = fit_cost_model(ps, ds, 100e9, 327680, name="synthetic")
    np.testing.assert_allclose(m.decode.coef, true_d, rtol=1e-6)
    # Noise of 0.1% on y: the dominant terms come back within a few percent.
    assert m.prefill.coef[1] == pytest.approx(true_p[1], rel=0.05)
    assert m.prefill.coef[3] == pytest.approx(true_p[3], rel=0.05)
    assert m.prefill.coef[4] == pytest.approx(true_p[4], rel=0.05)
    assert m.meta["prefill_fit"]["max_rel_error"] < 0.01
    assert m.prefill_s(50_000, 20_000) == pytest.approx(pm(50_000, 20_000), rel=0.01)


def test_fit_needs_enough_samples():
    with pytest.raises(ValueError, match="at least 5 samples"):
        PolyModel.fit([1, 2], [0, 0], [1, 2], PREFILL_TERMS)


def test_json_round_trip_and_errors(tmp_path):
    m = paper_cost_model()
    p = tmp_path / "cost.json"
    m.save(p)
    m2 = CostModel.load(p)
    assert m2 == m
    assert m2.prefill_s(12_000, 4_000) == m.prefill_s(12_000, 4_000)
    d = json.loads(p.read_text())
    d["version"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version 99"):
        CostModel.load(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        CostModel.load(p)
    d["version"] = 1
    del d["prefill"]
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="prefill"):
        CostModel.load(p)


def test_paper_setting_matches_table1_and_equation2():
    s = PaperSetting()
    assert s.kv_bytes_per_token == 327680            # 320 KB a token (section 2.2)
    # Equation 1 at peak: flops(n) = l*(a*n^2*d + b*n*d^2) over G.
    peak = paper_cost_model(PaperSetting(prefill_mfu=1.0))
    n = 8192
    flops = 80 * (4 * n * n * 8192 + 22 * n * 8192 ** 2)
    assert peak.prefill_s(n, 0) == pytest.approx(flops / (8 * 312e12), rel=1e-9)
    # Equation 2: reusing an 8,192-token prefix pays off from B ~ 6 GB/s on 8xA800, i.e.
    # moving the prefix's KV at 6 GB/s costs about as much as recomputing it.
    b_min = 8 * 312e12 * 2 * 8192 * 2 / (8 * (4 * n * 8192 + 22 * 8192 ** 2))
    assert b_min / 1e9 == pytest.approx(5.86, abs=0.01)
    at_b = CostModel(peak.prefill, peak.decode, TransferModel(b_min), s.kv_bytes_per_token)
    assert at_b.transfer_s(n) == pytest.approx(at_b.prefill_s(n, 0), rel=1e-9)
    # The default network (min(128 GB/s, 800 Gbps) = 100 GB/s) is far above that.
    assert paper_cost_model().transfer.bandwidth_bytes_per_s == 100e9
    # Cached tokens make the rest cheaper; decode steps grow with batch and context.
    m = paper_cost_model()
    assert m.prefill_s(4000, 8000) < m.prefill_s(12000, 0)
    assert m.decode_step_s(64, 500_000) > m.decode_step_s(1, 1000) > 0.01
    assert math.isclose(m.transfer_s(0), 0.0)
