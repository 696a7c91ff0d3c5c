"""Issue 13 with real processes: the stall metrics, the decode node's TBT admission check and
coupled mode.

Two module-scoped clusters on loopback (local coordination backend):
- P/D: c1 (cache role, API front end, started first so it leads), p1 (prefill), d1
  (decode). Every node has tbt_slo_s = 1 s. The leader's cost model predicts cheap decode
  steps (it admits everything); d1's own cost model says a step costs 0.6 s a request, so d1
  takes one request at a time and refuses a second (1.2 s > 1 s) itself;
- coupled: a1, one node of role all with cluster.coupled (its own conductor and API).

Every wait is bounded; the fixtures stop every process they started.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson
import pytest

from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call
from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel

READY_TIMEOUT_S = 300.0
KV_CACHE_BYTES = 64 << 20
CHEAP = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.05, 0.001)),
                  decode=PolyModel(((0, 0), (1, 0), (0, 1)), (0.01, 0.001, 1e-6)),
                  transfer=TransferModel(1e9), kv_bytes_per_token=46080, name="cheap",
                  meta={"source": "test"})
# 0.6 s a running request: one fits a 1 s TBT SLO, two do not
COSTLY = CostModel(prefill=CHEAP.prefill, decode=PolyModel(((1, 0),), (0.6,)),
                   transfer=TransferModel(1e9), kv_bytes_per_token=46080, name="costly",
                   meta={"source": "test"})
PROMPTS = ["The capital of France is", "Write one sentence about the sea:",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """(P/D cluster, coupled cluster), both ready."""
    tmp = tmp_path_factory.mktemp("stalls")
    CHEAP.save(tmp / "cheap.json")
    COSTLY.save(tmp / "costly.json")
    common = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
              "cluster.poll_interval_s": 0.1, "cluster.drain_timeout_s": 5.0,
              "conductor.cost_model": str(tmp / "cheap.json"),
              "conductor.refit_cost_model": False, "conductor.tbt_slo_s": 1.0,
              "engine.kv_cache_bytes": KV_CACHE_BYTES, "store.dram_bytes": 64 << 20,
              "server.request_timeout_s": 120.0}
    pd = LocalCluster(tmp / "pd", [
        NodeSpec("cache", "c1"), NodeSpec("prefill", "p1"),
        NodeSpec("decode", "d1", settings={"conductor.cost_model": str(tmp / "costly.json")})],
        settings=common)
    coupled = LocalCluster(tmp / "coupled", [NodeSpec("all", "a1",
                                                      settings={"cluster.coupled": True})],
                           settings=common)
    try:
        pd.start_backend()
        pd.start_node("c1")                 # first: it wins the first election
        pd.wait_ready(60, nodes=["c1"])
        pd.start_node("p1")
        pd.start_node("d1")
        coupled.start_backend()
        coupled.start_node("a1")
        pd.wait_ready(READY_TIMEOUT_S)
        coupled.wait_ready(READY_TIMEOUT_S)
        yield pd, coupled
    finally:
        pd.stop()
        coupled.stop()


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"{url}/v1/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), orjson.loads(e.read() or b"{}")


def _greedy(url: str, prompt: str) -> str:
    status, _, body = _post(url, {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def _metric(text: str, name: str, labels: str = "") -> float:
    """The value of the first `name` series whose labels include `labels` (every series
    also carries node and role labels)."""
    want = set(re.findall(r'(\w+)="([^"]*)"', labels))
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if m and want <= set(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")):
            return float(m.group(2))
    raise AssertionError(f"{name}{labels} not in /metrics")


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def test_coupled_gives_the_same_greedy_output_as_pd(clusters):
    pd, coupled = clusters
    got_pd = [_greedy(pd.api_url("c1"), p) for p in PROMPTS]
    got_coupled = [_greedy(coupled.api_url("a1"), p) for p in PROMPTS]
    assert got_coupled == got_pd
    assert all(t for t in got_pd)
    st = control_call(coupled.control("a1"), "conductor.status")
    assert st["nodes"]["a1"]["placed"] >= len(PROMPTS)     # placed by the conductor, coupled


def test_step_time_loop_lag_and_relay_histograms_in_metrics(clusters):
    pd, _ = clusters
    body = orjson.dumps({"prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True,
                         "stream": True})
    req = urllib.request.Request(f"{pd.api_url('c1')}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert b"[DONE]" in r.read()
    dec = _metrics(pd.api_url("d1"))
    assert _metric(dec, "mooncaked_engine_step_seconds_count", '{kind="decode"}') >= 10
    assert _metric(dec, "mooncaked_event_loop_lag_seconds_count") >= 1
    pre = _metrics(pd.api_url("p1"))
    assert _metric(pre, "mooncaked_engine_step_seconds_count", '{kind="prefill"}') >= 1
    front = _metrics(pd.api_url("c1"))
    assert _metric(front, "mooncaked_relay_delay_seconds_count") >= 10
    # and `mooncake ctl status` gets the summaries through node.status
    st = control_call(pd.control("d1"), "node.status")
    assert st["stalls"]["step"]["decode"]["count"] >= 10
    assert st["stalls"]["step"]["decode"]["p50_s"] > 0


def _prompt_tokens(pd: LocalCluster, node: str) -> int:
    """Prompt tokens the node's engine has scheduled so far (its prefills)."""
    return control_call(pd.control(node), "node.status")["engine"]["prompt_tokens_total"]


def test_decode_node_at_its_tbt_budget_refuses_with_429(clusters):
    """d1 runs one request (0.6 s a step by its cost model) and refuses a second (1.2 s >
    the 1 s TBT SLO). It answers when p1 asks it to admit the request, before p1
    computes: the client gets the 429 and p1 prefilled nothing (issue 31)."""
    pd, _ = clusters
    url = pd.api_url("c1")
    before = control_call(pd.control("d1"), "node.status")["requests"]["refused"]
    prefilled: list[int] = []

    async def run() -> tuple[int, dict, dict]:
        long = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(f"{url}/v1/completions", json=long) as r:
                assert r.status == 200
                # the first streamed tokens: d1 now runs this request (batch 1)
                seen = 0
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        seen += 1
                        if seen >= 3:
                            break
                prefilled.append(await asyncio.to_thread(_prompt_tokens, pd, "p1"))
                async with s.post(f"{url}/v1/completions",
                                  json={"prompt": PROMPTS[2], "max_tokens": 8}) as r2:
                    answer = r2.status, dict(r2.headers), await r2.json()
                prefilled.append(await asyncio.to_thread(_prompt_tokens, pd, "p1"))
                return answer

    status, headers, body = asyncio.run(run())
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "overloaded"
    assert "tbt_slo" in body["error"]["message"]
    assert "predicted TBT 1.200 s" in body["error"]["message"]
    assert prefilled[1] == prefilled[0] > 0        # the refused request cost p1 no prefill
    # the refusal names its request, whose decision d1's ledger holds (bench capacity joins
    # them so to attribute each refusal to its check)
    rid = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    led = control_call(pd.control("d1"), "admission.ledger", {"rids": [f"{rid}-0"]})
    assert led["node_check"]["decisions"][f"{rid}-0"]["verdict"] == "reject"
    after = control_call(pd.control("d1"), "node.status")["requests"]
    assert after["refused"] == before + 1
    # the refusal is in d1's admission ledger with its prediction (admission.ledger RPC)
    led = control_call(pd.control("d1"), "admission.ledger")
    assert led["node"] == "d1" and led["conductor"] is None        # c1 leads
    rejects = [d for d in led["node_check"]["decisions"].values() if d["verdict"] == "reject"]
    assert led["node_check"]["mode"] == "enforce" and len(rejects) == led["node_check"]["rejected"]
    assert abs(rejects[-1]["predicted_tbt_s"] - 1.2) < 1e-3 and rejects[-1]["reason"] == "tbt_slo"
    # and an operator sees it in `mooncake ctl status` (the node admission table's d1 row)
    out = subprocess.run([str(Path(sys.executable).parent / "mooncake"), "ctl", "status", "-c",
                          str(pd.write_ctl_config())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    table = out.stdout[out.stdout.index("node admission"):]
    row = next(ln for ln in table.splitlines() if " d1 " in f" {ln} ")
    assert re.search(rf"enforce\W+\d+\W+{led['node_check']['rejected']}\W", row), row
    # leave d1 idle for the other tests: the long request is aborted with its stream
    deadline = time.monotonic() + 30
    while control_call(pd.control("d1"), "node.status")["requests"]["decode"]:
        assert time.monotonic() < deadline, "d1 still runs the aborted request"
        time.sleep(0.1)    # poll interval; the condition is what d1 reports
