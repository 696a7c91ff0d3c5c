"""Readiness, liveness and the bounded wait for a conductor, on real processes (issue 18,
faults 5 and 6).

Cluster on the etcd backend: c1 (cache) starts alone, then p1 (prefill) and d1 (decode).
- Before a prefill and a decode node have joined, c1 answers /livez 200 and /health 503
  with a JSON reason; once they have, /health 200 and a request is served end to end.
- With etcd frozen (SIGSTOP) past the lease time there is no conductor: a request gets
  503 with Retry-After after about cluster.placement_wait_s, not request_timeout_s.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from mooncaked.coord.etcd_server import etcd_binary
from mooncaked.cluster.launcher import LocalCluster, NodeSpec

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                                "(mooncaked/coord/install_etcd.sh)")

READY_TIMEOUT_S = 300.0
PLACEMENT_WAIT_S = 2.0
LEASE_TTL_S = 2.0


def http(method: str, url: str, body: dict | None = None, timeout: float = 60.0
         ) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health_cluster")
    settings = {"cluster.lease_ttl_s": LEASE_TTL_S, "cluster.heartbeat_interval_s": 0.5,
                "cluster.op_timeout_s": 1.0, "cluster.rpc_timeout_s": 2.0,
                "cluster.placement_wait_s": PLACEMENT_WAIT_S, "cluster.drain_timeout_s": 2.0,
                "engine.kv_cache_bytes": 32 << 20, "store.dram_bytes": 16 << 20,
                "conductor.ttft_slo_s": 600.0, "conductor.tbt_slo_s": 600.0,
                "server.request_timeout_s": 120.0}
    cl = LocalCluster(tmp, [NodeSpec("cache", "c1"), NodeSpec("prefill", "p1"),
                            NodeSpec("decode", "d1")], backend="etcd", settings=settings)
    try:
        cl.start_backend()
        cl.start_node("c1")
        cl.wait_ready(60, nodes=["c1"])     # alive (/livez): no node can be ready yet
        yield cl
    finally:
        if cl.etcd is not None and cl.etcd.proc is not None:
            os.kill(cl.etcd.proc.pid, signal.SIGCONT)
        cl.stop()


def test_health_is_ready_only_once_the_cluster_can_serve_and_no_conductor_is_a_bounded_wait(
        cluster):
    api = cluster.api_url("c1")
    assert http("GET", f"{api}/livez")[:2] == (200, {"status": "alive"})
    status, body, _ = http("GET", f"{api}/health")
    assert status == 503 and body["status"] == "not_ready"
    assert "prefill" in body["reason"] and "decode" in body["reason"]

    for nid in ("p1", "d1"):
        cluster.start_node(nid)
    cluster.wait_ready(READY_TIMEOUT_S)
    status, body, _ = http("GET", f"{api}/health")
    assert (status, body["status"], body["node"]) == (200, "ok", "c1")
    req = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    status, body, _ = http("POST", f"{api}/v1/completions", req)
    assert status == 200, body

    # No conductor: etcd frozen, so the leader's lease lapses and no new one is elected.
    os.kill(cluster.etcd.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10 * LEASE_TTL_S + 30
        while True:
            assert time.monotonic() < deadline, "requests kept being placed with etcd frozen"
            t0 = time.monotonic()
            status, body, headers = http("POST", f"{api}/v1/completions", req)
            took = time.monotonic() - t0
            if status != 200:
                break
        assert status == 503, body
        assert body["error"]["code"] == "no_conductor", body
        assert int(headers["Retry-After"]) >= 1
        # bounded by placement_wait_s (+ one control call's timeout), not request_timeout_s
        assert took < PLACEMENT_WAIT_S + 2.0 + 5.0, took
    finally:
        os.kill(cluster.etcd.proc.pid, signal.SIGCONT)
