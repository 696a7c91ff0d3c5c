"""End to end on the etcd backend (a single-member etcd started by the launcher on
loopback): kill -9 of a prefill node with queued work (its requests are placed again
on the other prefill node), then kill -9 of the leader (a new one is elected and
requests succeed again).

Cluster: c1 (cache, started first: the conductor), p1 and p2 (prefill), d1 (decode).
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import orjson
import pytest

from mooncaked.cluster.etcd_server import etcd_binary
from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                                "(mooncaked/cluster/install_etcd.sh)")

READY_TIMEOUT_S = 300.0
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("etcd_cluster")
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.stream_idle_timeout_s": 6.0, "cluster.drain_timeout_s": 5.0,
                "engine.kv_cache_bytes": 64 << 20, "store.dram_bytes": 64 << 20,
                "conductor.ttft_slo_s": 600.0, "conductor.tbt_slo_s": 600.0,
                "server.request_timeout_s": 120.0,
                # this cluster moves KV the other way: the decode node READs it after the
                # prefill (the local-backend tests cover the layer-wise push)
                "cluster.layerwise_kv_push": False}
    cl = LocalCluster(tmp, [NodeSpec("cache", "c1"), NodeSpec("prefill", "p1"),
                            NodeSpec("prefill", "p2"), NodeSpec("decode", "d1")],
                      backend="etcd", settings=settings)
    try:
        cl.start_backend()
        cl.start_node("c1")
        cl.wait_ready(60, nodes=["c1"])
        for nid in ("p1", "p2", "d1"):
            cl.start_node(nid)
        cl.wait_ready(READY_TIMEOUT_S)
        yield cl
    finally:
        cl.stop()


def completion(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


async def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read())


def status(cl: LocalCluster, nid: str) -> dict:
    return control_call(cl.control(nid), "node.status", timeout_s=5.0)


def test_repeated_prefix_on_a_busy_node_is_fetched_elsewhere(cluster):
    """Cache load balancing (paper section 4.2): the node holding the prefix is busy, so the
    request goes to the idle prefill node, which fetches the blocks instead of recomputing."""
    api = cluster.api_url("c1")
    prompt = "Shared context: " + " ".join(f"item{i}" for i in range(40))
    code, first = asyncio.run(_post(f"{api}/v1/completions", completion(prompt, 2)))
    assert code == 200, first
    n = first["usage"]["prompt_tokens"]
    full = n // 16
    deadline = time.monotonic() + 10
    while True:   # wait until the holder's store events reached the conductor
        cst = control_call(cluster.control("c1"), "conductor.status")
        holder = next((p for p in ("p1", "p2") if cst["nodes"][p]["indexed_blocks"] >= full), None)
        if holder:
            break
        assert time.monotonic() < deadline, cst["nodes"]
        time.sleep(0.1)   # poll interval
    other = "p2" if holder == "p1" else "p1"
    # make the holder busy with a long prefill sent straight to it
    busy_prompt = list(range(1000, 1600))
    busy = threading.Thread(target=control_call, args=(cluster.control(holder), "node.prefill", {
        "rid": "busy-1", "prompt": busy_prompt, "params": {"max_tokens": 1, "temperature": 0.0},
        "stage": False}), kwargs={"timeout_s": 120})
    busy.start()
    try:
        deadline = time.monotonic() + 10
        while not control_call(cluster.control("c1"),
                               "conductor.status")["nodes"][holder]["prefill_pending"]:
            assert time.monotonic() < deadline, "the busy request never showed in reports"
            time.sleep(0.05)   # poll interval
        code, again = asyncio.run(_post(f"{api}/v1/completions", completion(prompt, 2)))
        assert code == 200, again
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 16 * 16 > 0
        st = status(cluster, other)
        assert st["store"]["dram_blocks"] >= full          # replicated onto the other node
        assert '"prefix_fetched"' in cluster.log_tail(other, 10**7)
        kv = status(cluster, "d1")["kv_transfer"]
        assert kv["read"] >= 1 and kv["read_bytes"] > 0 and kv["received_pushed"] == 0
    finally:
        busy.join(120)
    # the conductor sees the holder idle again (its view lags by one report)
    deadline = time.monotonic() + 10
    while control_call(cluster.control("c1"),
                       "conductor.status")["nodes"][holder]["prefill_pending"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)   # poll interval


def test_prefill_node_killed_with_queued_work(cluster):
    api = cluster.api_url("c1")
    prompts = [f"Request {i}: " + " ".join(["river"] * 120) for i in range(4)]

    async def run():
        tasks = [asyncio.create_task(_post(f"{api}/v1/completions", completion(p, 3)))
                 for p in prompts]
        # wait (bounded) until a prefill node holds work while more is queued, then kill it
        deadline = time.monotonic() + 30
        while True:
            victim = next((p for p in ("p1", "p2") if status(cluster, p)["requests"]["prefill"]),
                          None)
            if victim:
                break
            assert time.monotonic() < deadline, "no work reached a prefill node"
            await asyncio.sleep(0.05)
        cluster.kill(victim)
        return victim, await asyncio.wait_for(asyncio.gather(*tasks), 120)

    victim, results = asyncio.run(run())
    cluster.killed = [victim]
    for code, body in results:
        # every request completes (placed again on p2) or ends with a clear error
        if code == 200:
            assert body["usage"]["completion_tokens"] == 3
        else:
            assert code in (502, 503, 504) and victim in body["error"]["message"], body
    assert sum(code == 200 for code, _ in results) >= 3
    # what the victim held was placed again, not failed
    assert '"prefill_replaced"' in cluster.log_tail("c1", 10**7)
    st = status(cluster, "p2" if victim == "p1" else "p1")
    assert st["engine"]["kv_blocks_used"] == 0 and not st["requests"]["prefill"]


def test_leader_killed_on_etcd(cluster):
    assert status(cluster, "d1")["leader"] == "c1"
    cluster.kill("c1")
    deadline = time.monotonic() + 20
    while (status(cluster, "d1")["leader"] or "c1") == "c1":
        assert time.monotonic() < deadline, "no new leader within 20 s"
        time.sleep(0.1)   # poll interval
    leader = status(cluster, "d1")["leader"]
    assert leader in {"p1", "p2", "d1"} - set(getattr(cluster, "killed", []))
    code, body = asyncio.run(_post(f"{cluster.api_url('d1')}/v1/completions",
                                   completion("Hello there, how are", 4)))
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 4
