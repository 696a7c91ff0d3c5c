"""End to end on the etcd backend (the run's single-member etcd on loopback, conftest,
under a key prefix of this module's own): a prefix held by a busy prefill node is fetched by the idle one; kill -9 of a
prefill node with queued work (its requests are placed again on the other prefill node);
kill -9 of the leader (a new one is elected and requests succeed again).

Cluster: c1 (cache, started first: the first conductor), p1 and p2 (prefill), d1 (decode).
The tests run in any order and each one alone: each starts on a whole, idle cluster (the
autouse fixture restarts a node a failed test left dead), sends the prompts it needs itself
(fresh ones, so nothing another test cached matters), compares counters before and after,
and restarts what it killed before it ends. The cost model is fixed
(`conductor.refit_cost_model = false`): placement is what the default CPU model predicts.
No test assumes which node leads.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import uuid

import aiohttp
import orjson
import pytest
from cluster_harness import etcd_prefix, wait_until
from cluster_harness import node_status as status

from mooncaked.coord.etcd_server import etcd_binary
from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                                "(mooncaked/coord/install_etcd.sh)")

READY_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 180.0   # one node's restart (a model load) on two shared cores
IDLE_TIMEOUT_S = 30.0
MODEL = "SmolLM2-135M-Instruct.Q4_1"
NODES = ("c1", "p1", "p2", "d1")
MODEL_NODES = ("p1", "p2", "d1")
BLOCK = 16
LAYERS = 30
LAYER_BLOCK_BYTES = 2 * BLOCK * 3 * 64 * 4      # K and V of one block in one layer (fp32)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, etcd):
    """The four nodes on the run's shared etcd (conftest), under a key prefix of their own."""
    tmp = tmp_path_factory.mktemp("etcd_cluster")
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.stream_idle_timeout_s": 6.0, "cluster.drain_timeout_s": 5.0,
                "engine.kv_cache_bytes": 64 << 20, "store.dram_bytes": 64 << 20,
                "conductor.ttft_slo_s": 600.0, "conductor.tbt_slo_s": 600.0,
                "conductor.refit_cost_model": False,   # placement: the default model's say
                "server.request_timeout_s": 120.0,
                # this cluster moves KV the other way: the decode node READs it after the
                # prefill (the local-backend tests cover the layer-wise push)
                "cluster.layerwise_kv_push": False,
                "cluster.key_prefix": etcd_prefix("e2e")}
    cl = LocalCluster(tmp, [NodeSpec("cache", "c1"), NodeSpec("prefill", "p1"),
                            NodeSpec("prefill", "p2"), NodeSpec("decode", "d1")],
                      backend="etcd", etcd_endpoint=etcd.endpoint, settings=settings)
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


def completion(prompt: str | list[int], max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


def fresh() -> str:
    """A tag no other request used (from the OS: pytest-randomly reseeds `random`)."""
    return uuid.uuid4().hex


def reusable(prompt_tokens: int) -> int:
    """Prompt tokens a repeat finds cached: every full block but the one holding the last
    prompt token (engine/block_manager.py match_prefix)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


async def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read())


def live(cl: LocalCluster) -> list[str]:
    """The nodes whose process runs."""
    return [n for n in NODES if cl.procs[n].poll() is None]


def _agreed_leader(cl: LocalCluster) -> str | None:
    """The leader every live node names, if it is live and answers conductor.status."""
    try:
        names = {status(cl, n)["leader"] for n in live(cl)}
        if len(names) != 1 or next(iter(names)) not in live(cl):
            return None
        lead = names.pop()
        control_call(cl.control(lead), "conductor.status")
        return lead
    except (OSError, RuntimeError):
        return None


def leader(cl: LocalCluster, timeout_s: float = 20.0) -> str:
    """The current leader (whichever node it is), once every live node agrees on it."""
    return wait_until(lambda: _agreed_leader(cl), timeout_s, "one agreed leader")


def new_leader(cl: LocalCluster, old: str) -> str | None:
    """The agreed leader once it is another node than `old`, else None."""
    lead = _agreed_leader(cl)
    return lead if lead not in (None, old) else None


def conductor(cl: LocalCluster) -> dict:
    """conductor.status of the current leader."""
    return control_call(cl.control(leader(cl)), "conductor.status")


def _idle(cl: LocalCluster) -> bool:
    """Every node live, not draining and reporting; no request anywhere; no KV held."""
    lead = _agreed_leader(cl)
    if lead is None or set(live(cl)) != set(NODES):
        return False
    try:
        views = control_call(cl.control(lead), "conductor.status")["nodes"]
        sts = {n: status(cl, n) for n in NODES}
        return (all(not s["requests"]["prefill"] and not s["requests"]["decode"]
                    and not s["requests"]["frontend"] and s["requests"]["staged"] == 0
                    for s in sts.values())
                and all(sts[n]["engine"]["kv_blocks_used"] == 0 for n in MODEL_NODES)
                and all(n in views and views[n]["report_age_s"] is not None
                        and views[n]["report_age_s"] < 2.0 and not views[n]["draining"]
                        and views[n]["inflight"] == 0 and views[n]["prefill_pending"] == 0
                        for n in NODES))
    except (OSError, RuntimeError, KeyError):
        return False


@pytest.fixture(autouse=True)
def whole_idle_cluster(cluster):
    """Each test starts with every node running, seen live by the conductor, and idle; a node
    an earlier (failed) test left dead is restarted first."""
    for nid in NODES:
        if cluster.procs[nid].poll() is not None:
            cluster.restart_node(nid, RESTART_TIMEOUT_S)
    wait_until(lambda: _idle(cluster), IDLE_TIMEOUT_S, "a whole, idle cluster")
    yield


def restore(cl: LocalCluster, nid: str) -> None:
    """Restarts a node a test killed; waits (bounded) until the conductor has a report from
    the new process and every live node agrees on a leader."""
    cl.restart_node(nid, RESTART_TIMEOUT_S)
    leader(cl)


def test_repeated_prefix_on_a_busy_node_is_fetched_elsewhere(cluster):
    """Cache load balancing (paper section 4.2): the node holding the prefix is busy, so the
    request goes to the idle prefill node, which fetches the blocks instead of recomputing."""
    api = cluster.api_url("c1")
    prompt = "Shared context: " + " ".join(f"item{i}" for i in range(40))
    salt = fresh()
    indexed = {p: conductor(cluster)["nodes"][p]["indexed_blocks"] for p in ("p1", "p2")}
    code, first = asyncio.run(_post(f"{api}/v1/completions", completion(prompt, 2,
                                                                        cache_salt=salt)))
    assert code == 200, first
    n = first["usage"]["prompt_tokens"]
    full = n // BLOCK
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    def holder() -> str | None:   # whose store events with the prompt's blocks reached the index
        views = conductor(cluster)["nodes"]
        return next((p for p in ("p1", "p2")
                     if views[p]["indexed_blocks"] - indexed[p] == full), None)

    holder = wait_until(holder, 10, "the prompt's blocks indexed")
    other = "p2" if holder == "p1" else "p1"
    o_before, d_before = status(cluster, other), status(cluster, "d1")
    # make the holder busy with a long prefill sent straight to it
    busy_prompt = [random.Random(uuid.uuid4().int).randrange(1000, 40000) for _ in range(600)]
    busy = threading.Thread(target=control_call, args=(cluster.control(holder), "node.prefill", {
        "rid": f"busy-{fresh()}", "prompt": busy_prompt,
        "params": {"max_tokens": 1, "temperature": 0.0}, "stage": False}),
        kwargs={"timeout_s": 120})
    busy.start()
    try:
        wait_until(lambda: conductor(cluster)["nodes"][holder]["prefill_pending"], 10,
                   "the busy request in the holder's reports")
        code, again = asyncio.run(_post(f"{api}/v1/completions",
                                        completion(prompt, 2, cache_salt=salt)))
        assert code == 200, again
    finally:
        busy.join(120)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == reusable(n) > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # the other node fetched every full block of the prefix into its store, then prefilled
    o_after = status(cluster, other)
    kv = {k: o_after["kv_transfer"][k] - o_before["kv_transfer"][k]
          for k in ("fetches", "fetched_blocks", "fetch_failed")}
    assert kv == {"fetches": 1, "fetched_blocks": full, "fetch_failed": 0}, kv
    assert o_after["store"]["dram_blocks"] - o_before["store"]["dram_blocks"] == full
    # the decode node READ the staged KV (every layer of every prompt block) after the prefill
    d_after = status(cluster, "d1")["kv_transfer"]
    d = {k: d_after[k] - d_before["kv_transfer"][k]
         for k in ("read", "read_bytes", "received_pushed")}
    assert d == {"read": 1, "read_bytes": math.ceil(n / BLOCK) * LAYERS * LAYER_BLOCK_BYTES,
                 "received_pushed": 0}, d


def test_prefill_node_killed_with_queued_work(cluster):
    api = cluster.api_url("c1")
    tag = fresh()
    prompts = [f"Request {i} {tag}: " + " ".join(["river"] * 120) for i in range(4)]
    lead = leader(cluster)
    # a prefill node that does not lead, when there is one: killing the leader is another test
    candidates = [p for p in ("p1", "p2") if p != lead] or ["p1", "p2"]
    replaced = cluster.log_tail("c1", 10**8).count('"prefill_replaced"')
    victim = None

    async def run():
        nonlocal victim
        tasks = [asyncio.create_task(_post(f"{api}/v1/completions", completion(p, 3)))
                 for p in prompts]
        # wait (bounded) until a prefill node holds work while more is queued, then kill it
        deadline = time.monotonic() + 30
        while True:
            for p in candidates:
                if (await asyncio.to_thread(status, cluster, p))["requests"]["prefill"]:
                    victim = p
                    break
            if victim:
                break
            assert time.monotonic() < deadline, "no work reached a prefill node"
            await asyncio.sleep(0.05)
        cluster.kill(victim)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    try:
        results = asyncio.run(run())
        for code, body in results:
            # every request completes (placed again on the other node) or ends with a clear
            # error (one whose KV was staged on the victim when it died)
            if code == 200:
                assert body["usage"]["completion_tokens"] == 3
            else:
                assert code in (502, 503, 504) and victim in body["error"]["message"], body
        assert sum(code == 200 for code, _ in results) >= 3, results
        # what the victim held was placed again, not failed
        assert cluster.log_tail("c1", 10**8).count('"prefill_replaced"') > replaced
        survivor = "p2" if victim == "p1" else "p1"

        def survivor_idle() -> bool:
            st = status(cluster, survivor)
            return st["engine"]["kv_blocks_used"] == 0 and not st["requests"]["prefill"]

        wait_until(survivor_idle, 10, "the survivor idle")
    finally:
        if victim is not None:
            restore(cluster, victim)


def test_leader_killed_on_etcd(cluster):
    old = leader(cluster)
    front = next(n for n in ("d1", "c1", "p1", "p2") if n != old)   # an API that survives
    try:
        cluster.kill(old)
        new = wait_until(lambda: new_leader(cluster, old), 20, "a new leader")
        if old == "d1":              # the only decode node: nothing is served without it
            restore(cluster, old)
        code, body = asyncio.run(_post(f"{cluster.api_url(front)}/v1/completions",
                                       completion(f"Hello there {fresh()}, how are", 4)))
        assert code == 200, body
        assert body["usage"]["completion_tokens"] == 4
        assert leader(cluster) == new
    finally:
        if cluster.procs[old].poll() is not None:
            restore(cluster, old)
