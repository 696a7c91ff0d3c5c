"""Measured bandwidth: the busy-period meter (transfer/bandwidth.py), the engine measuring a
real path (loopback, and a 100mbit-shaped host link as root), the report that carries it,
and the cost model's fetch-or-recompute switching with it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from mooncaked.cluster.hosts import Hosts
from mooncaked.wire.messages import NodeReport
from mooncaked.conductor.cost_model import (CostModel, PolyModel, TransferModel,
                                            with_measured_bandwidth)
from mooncaked.config import TransferSettings
from mooncaked.transfer import TransferEngine
from mooncaked.transfer.bandwidth import BandwidthMeter

MiB = 1 << 20


def test_meter_counts_overlapping_requests_as_one_busy_period():
    m = BandwidthMeter(alpha=0.5, min_sample_bytes=1 << 20)
    # four 1 MiB requests overlapping over one second: the link moved 4 MiB/s, though
    # each request alone took a second
    for _ in range(4):
        m.begin("b", 10.0)
    for end in (10.25, 10.5, 10.75, 11.0):
        m.end("b", end, MiB)
    e = m.estimate("b")
    assert e is not None and e.samples == 1 and e.bytes == 4 * MiB
    assert e.bytes_per_s == pytest.approx(4 * MiB / 1.0)
    # a second period at 2 MiB/s: the smoothed estimate moves halfway (alpha 0.5)
    m.begin("b", 20.0)
    m.end("b", 21.0, 2 * MiB)
    assert m.estimate("b").bytes_per_s == pytest.approx(3 * MiB)
    # small periods are latency, not bandwidth; failures move nothing
    m.begin("b", 30.0)
    m.end("b", 30.001, 4096)
    m.begin("b", 31.0)
    m.end("b", 35.0, 0)
    assert m.estimate("b").samples == 2
    assert m.estimate("c") is None and set(m.estimates()) == {"b"}


def test_meter_samples_a_path_that_never_idles():
    m = BandwidthMeter(alpha=1.0, min_sample_bytes=1, max_period_s=1.0)
    m.begin("b", 0.0)
    t = 0.0
    for _ in range(30):                 # always one request in flight: 1 MiB every 0.1 s
        m.begin("b", t)
        t += 0.1
        m.end("b", t, MiB)
    assert m.estimate("b").samples >= 2
    assert m.estimate("b").bytes_per_s == pytest.approx(10 * MiB, rel=0.01)


def test_meter_a_request_ending_just_after_a_cut_does_not_read_as_a_fast_link():
    m = BandwidthMeter(alpha=0.3, min_sample_bytes=1, max_period_s=1.0)
    # one transfer in two slices over a 10 MiB/s link, 6 MiB each, ending together after
    # 1.2 s: the first ends the period (cut at max_period_s), the second 10 ms later lands
    # all its 6 MiB in a 10 ms sample (600 MiB/s as a rate of its own)
    for t in (0.0, 10.0, 20.0):
        m.begin("b", t)
        m.begin("b", t)
        m.end("b", t + 1.19, 6 * MiB)
        m.end("b", t + 1.2, 6 * MiB)
    e = m.estimate("b")
    assert e.samples == 6 and e.bytes == 36 * MiB
    # bytes over seconds: within the smoothing's wobble of the link (a mean of the
    # samples' rates read 314 MiB/s here)
    assert 9 * MiB < e.bytes_per_s < 11 * MiB, e.bytes_per_s / MiB


def _cost(bandwidth: float) -> CostModel:
    # prefill 2 ms a new token; 46 KB of KV a token (the bundled model, fp32)
    return CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.0, 0.002)),
                     decode=PolyModel(((0, 0),), (0.01,)),
                     transfer=TransferModel(bandwidth, 0.002), kv_bytes_per_token=46_080)


def test_cost_model_uses_the_measured_median():
    base = _cost(1e9)
    assert with_measured_bandwidth(base, []) is base
    used = with_measured_bandwidth(base, [12.5e6, 118e6, 125e6, 0.0])
    assert used.transfer.bandwidth_bytes_per_s == 118e6
    assert used.transfer.latency_s == base.transfer.latency_s
    # fetch-or-recompute of a 1,000-token prefix: recomputing costs 2 s; a 1 Gbit/s link
    # moves its 46 MB in 0.39 s, a 100 Mbit/s link in 3.7 s
    prefix = 1000
    recompute = base.prefill_s(prefix, 0)
    fast = with_measured_bandwidth(base, [125e6]).transfer_s(prefix)
    slow = with_measured_bandwidth(base, [12.5e6]).transfer_s(prefix)
    assert fast < recompute < slow


def test_report_carries_the_links():
    r = NodeReport("p0", "prefill", links={"c0": 1.18e8, "d0": 9.9e7})
    back = NodeReport.from_json(json.loads(json.dumps(r.to_json())))
    assert back.links == {"c0": 1.18e8, "d0": 9.9e7}
    assert NodeReport.from_json({"node": "x"}).links == {}


def _engine_measures(host: str, wrap, n: int = 24) -> float:
    """Starts a transfer peer (wrapped, e.g. into a host), WRITEs n 1 MiB blocks to it four
    at a time, returns what the engine measured on the path, bytes/s."""
    peer = subprocess.Popen(wrap([sys.executable, "-m", "mooncaked.transfer.peer", "--node-id",
                                  "peer", "--segment", f"seg={8 * MiB}", "--backend", "tcp",
                                  "--host", host]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(peer.stdout.readline())

        async def go() -> float:
            engine = TransferEngine(TransferSettings(backend="tcp"), node_id="me")
            await engine.start()
            try:
                engine.add_peer_segment(ready["descriptors"]["seg"])
                src = bytearray(os.urandom(MiB))
                for i in range(0, n, 4):
                    await asyncio.gather(*(engine.write("seg", k * MiB, src)
                                           for k in range(4)))
                return engine.bandwidth.estimate("peer").bytes_per_s
            finally:
                await engine.close()
        return asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        peer.stdin.close()
        peer.wait(10)


def test_engine_measures_loopback_as_fast():
    assert _engine_measures("127.0.0.1", lambda cmd: cmd) > 100e6   # > 100 MB/s


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_engine_measures_a_shaped_link(tmp_path):
    with Hosts(["peer"], link_rate="100mbit", record_dir=tmp_path) as hosts:
        measured = _engine_measures(hosts.address("peer"),
                                    lambda cmd: hosts.command("peer", cmd), n=12)
    assert 0.8 * 12.5e6 <= measured <= 1.1 * 12.5e6, measured
