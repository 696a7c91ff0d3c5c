"""End to end: a disaggregated cluster of real `mooncaked serve` processes on loopback
(local coordination backend), against a single-process `--role all` reference.

One module-scoped cluster: c1 (cache role, API front end, started first so it is the
conductor), p1 (prefill), d1 and d2 (decode). The tests run in file order and the
last two are destructive (kill -9 of a decode node mid-stream, then of the leader).
Every wait is bounded; the fixture always stops every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson
import pytest

from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call, free_port
from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300.0     # four model loads on two shared cores
MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = ("The Mooncake paper describes a serving system that separates prefill and decode. "
          "In one sentence, the main idea of that design is")

# A cost model with known numbers, so admission is predictable: prefill 0.3 s + 2 ms a new
# token; cheap decode steps. With ttft_slo_s = 3, a third 300-token request waiting behind two
# others is predicted at 3 * 0.9 s = 2.7 s (admitted), a fourth at 3.6 s (rejected).
TEST_COST = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.3, 0.002)),
                      decode=PolyModel(((0, 0), (1, 0), (0, 1)), (0.05, 0.001, 1e-5)),
                      transfer=TransferModel(1e9), kv_bytes_per_token=46080, name="test",
                      meta={"source": "test"})


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(cluster, reference URL): the cluster and a `--role all` process, both ready."""
    tmp = tmp_path_factory.mktemp("cluster")
    cost = tmp / "cost_model.json"
    TEST_COST.save(cost)
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.poll_interval_s": 0.1, "cluster.stream_idle_timeout_s": 6.0,
                "cluster.drain_timeout_s": 5.0, "conductor.cost_model": str(cost),
                "conductor.ttft_slo_s": 3.0, "conductor.tbt_slo_s": 10.0,
                "engine.kv_cache_bytes": 64 << 20, "store.dram_bytes": 64 << 20,
                "server.request_timeout_s": 120.0}
    # c1 gets a systemd notification socket, as under Type=notify
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.setblocking(False)
    c1 = NodeSpec("cache", "c1", env={"NOTIFY_SOCKET": str(tmp / "notify.sock")})
    cluster = LocalCluster(tmp / "c", [c1, NodeSpec("prefill", "p1"),
                                       NodeSpec("decode", "d1"), NodeSpec("decode", "d2")],
                           settings=settings)
    ref_port = free_port()
    ref_log = (tmp / "ref.log").open("wb")
    ref = subprocess.Popen([str(BIN / "mooncaked"), "serve", "--role", "all", "--port",
                            str(ref_port), "--set", "engine.kv_cache_bytes=67108864"],
                           stdout=ref_log, stderr=subprocess.STDOUT, cwd=tmp,
                           start_new_session=True)
    ref_url = f"http://127.0.0.1:{ref_port}"
    try:
        cluster.start_backend()
        cluster.start_node("c1")                       # first: it wins the election
        cluster.wait_ready(60, nodes=["c1"])
        for nid in ("p1", "d1", "d2"):
            cluster.start_node(nid)
        cluster.wait_ready(READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _health(ref_url):
            assert ref.poll() is None, (tmp / "ref.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "reference server not ready"
            time.sleep(0.2)   # poll interval; readiness is /health
        cluster.notify = notify
        yield cluster, ref_url
    finally:
        notify.close()
        cluster.stop()
        if ref.poll() is None:
            ref.send_signal(signal.SIGTERM)
            try:
                ref.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(ref.pid, signal.SIGKILL)
                ref.wait(10)
        ref_log.close()


async def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read()), dict(r.headers)


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, dict]:
    return asyncio.run(_post(url, body, timeout))


async def _stream_events(resp: aiohttp.ClientResponse):
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[6:]
            yield payload if payload == "[DONE]" else orjson.loads(payload)


def completion(max_tokens: int, prompt: str = PROMPT, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


def status(cluster: LocalCluster, nid: str) -> dict:
    return control_call(cluster.control(nid), "node.status", timeout_s=5.0)


def wait_until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)   # poll interval


# ---------------------------------------------------------------------------- tests


def test_ready_is_notified_to_systemd(env):
    cluster, _ = env
    msgs = []
    while True:
        try:
            msgs.append(cluster.notify.recv(4096).decode())
        except BlockingIOError:
            break
    assert "READY=1" in msgs


def kv_counters(cluster: LocalCluster) -> dict:
    """Sum of every model node's kv_transfer counters."""
    total: dict = {}
    for nid in ("p1", "d1", "d2"):
        for k, v in status(cluster, nid)["kv_transfer"].items():
            total[k] = total.get(k, 0) + v
    return total


def test_greedy_output_equals_single_process(env):
    cluster, ref = env
    api = cluster.api_url("c1")
    before = kv_counters(cluster)
    code, got, _ = post(f"{api}/v1/completions", completion(16))
    assert code == 200, got
    code, want, _ = post(f"{ref}/v1/completions", completion(16))
    assert code == 200, want
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 16
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 12, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def chat_text(url: str) -> tuple[str, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(f"{url}/v1/chat/completions", data=orjson.dumps(chat)) as r:
                assert r.status == 200, await r.text()
                events = [e async for e in _stream_events(r)]
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                       if isinstance(e, dict) and e["choices"])
        return text, events[-2]["usage"]

    (c_text, c_usage), (r_text, r_usage) = asyncio.run(chat_text(api)), asyncio.run(chat_text(ref))
    assert c_text == r_text and c_text
    assert c_usage["completion_tokens"] == r_usage["completion_tokens"]
    # both requests' KV was pushed layer by layer into the decode node (no READ after)
    after = kv_counters(cluster)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["pushed"] == delta["received_pushed"] == 2, delta
    assert delta["push_failed"] == delta["read"] == 0, delta
    layers = 30        # SmolLM2-135M: each request sends every layer's KV at least once
    assert delta["push_bytes"] >= 2 * layers * 2 * 16 * 3 * 64 * 4, delta


def test_repeated_prefix_reports_cached_tokens(env):
    cluster, _ = env
    code, first, _ = post(f"{cluster.api_url('c1')}/v1/completions", completion(2))
    assert code == 200
    code, again, _ = post(f"{cluster.api_url('c1')}/v1/completions", completion(2))
    assert code == 200
    n = again["usage"]["prompt_tokens"]
    # every full block but the one holding the last prompt token is reusable
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // 16 * 16 > 0
    # the prefill node's store published the prompt's blocks to the conductor's index
    st = control_call(cluster.control("c1"), "conductor.status")
    assert st["nodes"]["p1"]["indexed_blocks"] >= n // 16


def test_hot_prefix_is_replicated_onto_the_cache_node(env):
    cluster, _ = env
    prompt = "A hot system prompt that many requests share. " * 8

    def conductor() -> dict:
        return control_call(cluster.control("c1"), "conductor.status")

    before = conductor()
    code, body, _ = post(f"{cluster.api_url('c1')}/v1/completions", completion(2, prompt))
    assert code == 200, body
    n = body["usage"]["prompt_tokens"]
    reused = (n - 1) // 16
    # the conductor replicates only blocks its index shows held: wait for p1's store events
    wait_until(lambda: conductor()["nodes"]["p1"]["indexed_blocks"]
               >= before["nodes"]["p1"]["indexed_blocks"] + reused, 10, "p1's blocks indexed")
    before = before["replication"]
    for _ in range(2):      # requested again twice: hot at conductor.hot_block_hits = 2
        code, body, _ = post(f"{cluster.api_url('c1')}/v1/completions", completion(2, prompt))
        assert code == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= reused * 16
    # the cache node fetches the prefix from p1's store; its store events reach the index
    deadline = time.monotonic() + 20
    while True:
        st = control_call(cluster.control("c1"), "conductor.status")
        if st["replication"]["blocks"] - before["blocks"] >= reused \
                and st["nodes"]["c1"]["indexed_blocks"] >= reused:
            break
        assert time.monotonic() < deadline, (before, st["replication"], st["nodes"])
        time.sleep(0.1)   # poll interval
    assert st["replication"]["failed"] == before["failed"]
    assert status(cluster, "c1")["store"]["dram_blocks"] >= reused


def test_receive_buffers_belong_to_their_prefill_node(env):
    """node.kv_reserve: a second attempt of a request replaces the first one's buffer, and
    only the prefill node that reserved a buffer can release it."""
    cluster, _ = env
    d1 = cluster.control("d1")
    shape = [30, 2, 2, 16, 3, 64]                      # SmolLM2-135M, 2 blocks
    ask = {"rid": "r-own", "shape": shape, "dtype": "float32", "ttl_s": 30}
    first = control_call(d1, "node.kv_reserve", {**ask, "owner": "p-a"})
    second = control_call(d1, "node.kv_reserve", {**ask, "owner": "p-b"})
    assert first["descriptor"]["access_key"] != second["descriptor"]["access_key"]
    assert status(cluster, "d1")["requests"]["receiving"] == 1
    assert not control_call(d1, "node.release", {"rid": "r-own", "owner": "p-a"})["released"]
    assert status(cluster, "d1")["requests"]["receiving"] == 1
    assert control_call(d1, "node.release", {"rid": "r-own", "owner": "p-b"})["released"]
    assert status(cluster, "d1")["requests"]["receiving"] == 0
    with pytest.raises(Exception, match="does not match"):
        control_call(d1, "node.kv_reserve", {**ask, "shape": [30, 2, 2, 16, 3, 32],
                                             "owner": "p-a"})


def test_client_disconnect_frees_kv_on_both_sides(env):
    cluster, _ = env

    async def start_and_drop() -> int:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            r = await s.post(f"{cluster.api_url('c1')}/v1/completions",
                             data=orjson.dumps(completion(200, stream=True)))
            assert r.status == 200
            got = 0
            async for e in _stream_events(r):
                if isinstance(e, dict) and e["choices"][0]["text"]:
                    got += 1
                if got >= 3:
                    break
            r.close()            # the client goes away mid-stream
            return got

    assert asyncio.run(start_and_drop()) == 3
    t0 = time.monotonic()
    wait_until(lambda: all_freed(cluster), 5.0, "KV freed on the prefill and decode nodes")
    assert time.monotonic() - t0 < 2.0


def all_freed(cluster: LocalCluster) -> bool:
    """No request, staged KV, receive buffer or used KV block on any model node."""
    sts = [status(cluster, n) for n in ("p1", "d1", "d2")]
    return all(not s["requests"]["prefill"] and not s["requests"]["decode"]
               and s["requests"]["staged"] == 0 and s["requests"]["receiving"] == 0
               and s["engine"]["kv_blocks_used"] == 0
               and s["engine"]["num_running"] == 0 for s in sts)


def test_client_disconnect_during_a_pushed_prefill_frees_both_sides(env):
    """The client leaves while the prefill node is still pushing layers into the decode
    node's receive buffer: the prefill is aborted and the buffer is released."""
    cluster, _ = env
    prompt = " ".join(f"w{i}" for i in range(360))       # ~1,300 tokens: a long prefill

    async def start_and_drop() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            # the API answers the headers with the first token: send without waiting
            req = asyncio.ensure_future(s.post(f"{cluster.api_url('c1')}/v1/completions",
                                               data=orjson.dumps(completion(20, prompt,
                                                                            stream=True))))
            await asyncio.to_thread(
                wait_until, lambda: any(status(cluster, d)["requests"]["receiving"]
                                        for d in ("d1", "d2")), 60, "a receive buffer")
            req.cancel()         # the client goes away before the first token
            with contextlib.suppress(asyncio.CancelledError):
                await req

    asyncio.run(start_and_drop())
    t0 = time.monotonic()
    wait_until(lambda: all_freed(cluster), 5.0, "KV freed on the prefill and decode nodes")
    assert time.monotonic() - t0 < 2.0


def test_overload_is_rejected_early_with_retry_after(env):
    cluster, _ = env
    long_prompt = " ".join(["stone"] * 300)

    async def burst():
        async def one():
            t0 = time.monotonic()
            code, body, headers = await _post(f"{cluster.api_url('c1')}/v1/completions",
                                              completion(2, prompt=long_prompt), timeout=300)
            return code, body, headers, time.monotonic() - t0
        return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(burst())
    codes = sorted(r[0] for r in results)
    rejected = [r for r in results if r[0] == 429]
    assert codes.count(200) >= 1 and len(rejected) >= 2, codes
    for code, body, headers, seconds in rejected:
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["code"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1
        assert seconds < 3.0          # rejected at once, not after queueing
    for code, body, _, _ in results:
        if code == 200:
            assert body["usage"]["completion_tokens"] == 2


def ctl(cluster: LocalCluster, *args: str) -> dict:
    """Runs `mooncake ctl ARGS --json -c <cluster.toml>`; returns its JSON output."""
    cp = subprocess.run([str(BIN / "mooncake"), "ctl", *args, "--json", "-c",
                         str(cluster.write_ctl_config())], capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr[-2000:]
    return orjson.loads(cp.stdout)


def test_ctl_shows_leader_nodes_cache_and_requests(env):
    cluster, _ = env
    st = ctl(cluster, "status")
    assert st["leader"] == "c1" and st["backend"] == "local"
    assert {n: v["info"]["role"] for n, v in st["nodes"].items()} == \
        {"c1": "cache", "p1": "prefill", "d1": "decode", "d2": "decode"}
    assert all("status" in v and not v["status"]["draining"] for v in st["nodes"].values())
    assert st["conductor"]["placed"] >= 5 and st["conductor"]["rejected"].get("ttft_slo", 0) >= 2
    assert st["conductor"]["cost_model"]["source"] == "test"
    # the decode nodes' timed steps reach the conductor, which scores its predictions
    dec = st["conductor"]["decode_step_prediction"]
    assert dec["samples"] >= 10 and dec["median_abs_rel_error"] is not None
    assert st["nodes"]["p1"]["status"]["kv_transfer"]["pushed"] >= 2
    cache = ctl(cluster, "cache")
    assert cache["p1"]["dram_blocks"] > 0 and cache["p1"]["indexed_blocks"] == \
        cache["p1"]["dram_blocks"]
    assert cache["p1"]["prefix_hit_rate"] > 0
    req = ctl(cluster, "requests")
    assert set(req) == {"c1", "p1", "d1", "d2"}
    assert all(r["prefill"] == [] and r["decode"] == [] and r["staged"] == 0
               for r in req.values())


def test_decode_node_killed_mid_stream(env):
    cluster, _ = env
    api = cluster.api_url("c1")

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            a = await s.post(f"{api}/v1/completions",
                             data=orjson.dumps(completion(400, stream=True)))
            ait = _stream_events(a)
            assert (await anext(ait))["choices"][0]["text"] is not None
            victim = wait_until(lambda: next((n for n in ("d1", "d2")
                                              if status(cluster, n)["requests"]["decode"]), None),
                                10, "request A decoding")
            other = "d2" if victim == "d1" else "d1"
            b = await s.post(f"{api}/v1/completions",
                             data=orjson.dumps(completion(60, stream=True)))
            bit = _stream_events(b)
            await anext(bit)
            wait_until(lambda: status(cluster, other)["requests"]["decode"], 10,
                       "request B decoding on the other node")
            t0 = time.monotonic()
            cluster.kill(victim)                           # kill -9
            a_events = [e async for e in ait]
            a_s = time.monotonic() - t0
            b_events = [e async for e in bit]
            return victim, a_events, a_s, b_events

    victim, a_events, a_s, b_events = asyncio.run(run())
    errors = [e for e in a_events if isinstance(e, dict) and "error" in e]
    assert errors and victim in errors[0]["error"]["message"], a_events[-3:]
    assert a_events[-1] == "[DONE]"
    assert a_s < 6.0 + 2.0        # within the stream's idle timeout
    assert b_events[-1] == "[DONE]"
    assert b_events[-2]["choices"][0]["finish_reason"] == "length"
    # new requests avoid the dead node (re-dispatched until the conductor drops it)
    code, body, _ = post(f"{api}/v1/completions", completion(4))
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 4


def test_leader_killed_new_leader_serves(env):
    cluster, _ = env
    assert status(cluster, "p1")["leader"] == "c1"
    cluster.kill("c1")                                     # kill -9 of the conductor
    t0 = time.monotonic()
    new_leader = wait_until(lambda: (status(cluster, "p1")["leader"] or "c1") != "c1"
                            and status(cluster, "p1")["leader"], 15, "a new leader")
    assert new_leader in ("p1", "d1", "d2")
    # requests through another node's API front end succeed again
    code, body, _ = post(f"{cluster.api_url('p1')}/v1/completions", completion(4), timeout=60)
    assert code == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert time.monotonic() - t0 < 45
    # the new conductor rebuilt its index from the nodes' inventories
    st = control_call(cluster.control(new_leader), "conductor.status")
    assert st["nodes"]["p1"]["indexed_blocks"] > 0


def test_sigterm_drains_running_requests_then_exits(env):
    cluster, _ = env
    survivor = next(n for n in ("d1", "d2") if cluster.procs[n].poll() is None)
    api = cluster.api_url("p1")

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            r = await s.post(f"{api}/v1/completions",
                             data=orjson.dumps(completion(24, stream=True)))
            it = _stream_events(r)
            await anext(it)
            wait_until(lambda: status(cluster, survivor)["requests"]["decode"], 10, "decoding")
            cluster.kill(survivor, signal.SIGTERM)          # graceful stop: drain, then exit
            return [e async for e in it]

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"   # it finished, not aborted
    assert cluster.procs[survivor].wait(15) == 0


def test_ctl_drain_takes_node_out_of_placement(env):
    cluster, _ = env
    r = ctl(cluster, "drain", "p1")
    assert r["draining"] is True
    wait_until(lambda: status(cluster, "p1")["draining"], 5, "p1 draining")
    # no prefill node is left: the request is refused at once, with a retry hint
    code, body, headers = post(f"{cluster.api_url('p1')}/v1/completions", completion(2))
    assert code == 503 and body["error"]["code"] == "no_capacity", body
    assert int(headers["Retry-After"]) >= 1
