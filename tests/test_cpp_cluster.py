"""End to end: a chunked-pipeline-parallel (CPP) group of two stage nodes inside a cluster of
real `mooncaked serve` processes on loopback (issue 14).

One module-scoped cluster: g0s0 and g0s1 (prefill nodes configured as stages 0 and 1 of
group g0, as `mooncake up --prefill 3 --cpp 2` names them), prefill0 (a single prefill node)
and decode0 (the API every test talks to). Chunks of 32 tokens and `cpp_min_tokens` = 64
with the fixed default cost model: a 64+-token prompt is predicted faster on the group, a
shorter one on prefill0. Which node prefilled is read from the API node's `request_done`
log line; every long prompt carries a fresh cache salt, so no single node holds a prefix of
it (a cached prefix below cpp_min_tokens uncached rightly keeps a request off the group).
decode0 checks TBT itself (tbt_slo_s 1 s, its own cost model: 10 ms + 0.4 ms a context
token a step, so only ~2,500 context tokens or more break it: one ~3,000-token prompt does,
the concurrent test's 7 x ~240 do not); the conductor's admission is off, so that refusal is
decode0's whichever node leads.
Tests run in any order: each starts with every node healthy and undrained
(autouse fixture) and undoes its drains; the kill test restarts the stage it killed.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.client import HTTPConnection
from pathlib import Path

import orjson
import pytest
from cluster_harness import CONSTRAINED_LOGPROBS, logprob_values, wait_until

from mooncaked.cluster.cpp.pipeline_stage import HELD_IDLE_FACTOR
from mooncaked.cluster.launcher import LocalCluster, cluster_specs, control_call
from mooncaked.conductor.cost_model import PolyModel
from mooncaked.conductor.cost_store import default_cost_model

BIN = Path(sys.executable).parent
MODEL = "SmolLM2-135M-Instruct.Q4_1"
READY_TIMEOUT_S = 300.0
WAIT_S = 60.0          # generous: the suite shares two cores with other work
# "within a few seconds": what a dead stage's peers take to free a request (5 s timed out
# once in CI, 2 workers and 7 node processes on 2 cores; 2-3 s alone)
FREE_S = 10.0
NODES = ("g0s0", "g0s1", "prefill0", "decode0")
LONG = " ".join(f"item{i}" for i in range(60))           # ~170 tokens: the group's
TBT_SLO_S = 1.0
KV_BYTES_PER_TOKEN = 46080          # SmolLM2-135M, fp32 KV: 30 layers x 2 x 3 heads x 64 x 4
SHORT = "Hello there"                                   # a few tokens: prefill0's


def http(method: str, url: str, body: dict | None = None, timeout_s: float = 120.0
         ) -> tuple[int, dict]:
    """(status, JSON body) of one request; HTTP errors are answers too."""
    req = urllib.request.Request(url, method=method, headers={"Content-Type": "application/json"},
                                 data=orjson.dumps(body) if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, orjson.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpp")
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.poll_interval_s": 0.1, "cluster.drain_timeout_s": 5.0,
                "conductor.refit_cost_model": False,      # placement stays what the default predicts
                "conductor.cpp_min_tokens": 64, "cpp.chunk_tokens": 32, "cpp.idle_timeout_s": 2.0,
                # a context of 3,640 tokens (160 MiB / 46,080 bytes a token): room for the
                # refusal test's prompt
                "engine.kv_cache_bytes": 160 << 20,
                # stores large enough that the module never evicts (a prefix test counts
                # stored blocks)
                "store.dram_bytes": 192 << 20,
                # With decode0 offloading, a repeated prompt's blocks are on decode0, and
                # prefill0 fetching them leaves less than cpp_min_tokens uncached, which
                # rightly keeps the request off the group. This module tests the group's
                # own prefix reuse, so decode0 keeps nothing.
                "store.decode_offload": False,
                "model.num_threads": 1, "conductor.admission": "off"}
    # decode0's own TBT check: the default model's prefill (placement is the same whichever
    # node leads), decode steps of 10 ms + 0.4 ms a context token
    slow = dataclasses.replace(default_cost_model(KV_BYTES_PER_TOKEN),
                               decode=PolyModel(((0, 0), (0, 1)), (0.01, 4e-4)), name="tbt-test",
                               meta={"source": "test"})
    slow.save(tmp / "decode0-cost.json")
    nodes = [dataclasses.replace(n, settings={**n.settings,
                                              "conductor.cost_model": str(tmp / "decode0-cost.json"),
                                              "conductor.tbt_slo_s": TBT_SLO_S})
             if n.node_id == "decode0" else n
             for n in cluster_specs(cache=0, prefill=3, decode=1, cpp=2)]
    assert [n.node_id for n in nodes] == list(NODES)
    cl = LocalCluster(tmp / "c", nodes, settings=settings)
    with cl:
        yield cl


@pytest.fixture(autouse=True)
def healthy(cluster):
    """Before each test: every node answers /health 200 (not draining, joined), and the
    conductor sees group g0 complete (a restarted stage's member record has reached it)."""
    wait_until(lambda: all(http("GET", f"{cluster.api_url(n)}/health")[0] == 200 for n in NODES),
               WAIT_S, "every node healthy")
    wait_until(lambda: ((cluster.status() or {}).get("cpp_groups") or {}).get("complete")
               == {"g0": ["g0s0", "g0s1"]}, WAIT_S, "the conductor to see group g0 complete")
    yield


def idle(cl: LocalCluster) -> None:
    """Waits until the conductor sees no prefill queued or in flight anywhere: placement
    compares predicted queues, so a report still counting the previous request would
    send the next one elsewhere."""
    def quiet() -> bool:
        st = cl.status()
        return st is not None and all(v["prefill_pending"] == 0 and v["inflight"] == 0
                                      for v in st["nodes"].values())
    wait_until(quiet, WAIT_S, "the conductor to see every node idle")


def complete(cl: LocalCluster, prompt: str, max_tokens: int = 10, **extra) -> tuple[int, dict]:
    idle(cl)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return http("POST", f"{cl.api_url('decode0')}/v1/completions", body)


def prefilled_on(cl: LocalCluster, body: dict) -> str:
    """The node that prefilled a finished completion, from the API node's `request_done`
    line (the conductor's counters restart with a new leader, which a drain can cause)."""
    def find() -> str | None:
        for line in cl.log_path("decode0").read_text().splitlines():
            if '"request_done"' in line and body["id"] in line:
                r = orjson.loads(line)
                if r.get("status") == "finished":
                    return r["prefill"]
        return None
    return wait_until(find, WAIT_S, f"the request_done line of {body['id']}")


def set_draining(cl: LocalCluster, node: str, draining: bool) -> None:
    """Drains (or undrains) node and waits until the conductor knows."""
    control_call(cl.control(node), "node.drain" if draining else "node.undrain")
    wait_until(lambda: (cl.status() or {}).get("nodes", {}).get(node, {}).get("draining")
               is draining, WAIT_S, f"the conductor to see {node} draining={draining}")


def test_ctl_status_lists_the_group_its_stages_and_layers(cluster):
    out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "-c",
                          str(cluster.write_ctl_config())], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "g0s" in line and " g0 " in line]
    assert len(rows) == 2, out.stdout
    assert "0/2" in rows[0] and "0-14 (15 of 30)" in rows[0], rows
    assert "1/2" in rows[1] and "15-29 (15 of 30)" in rows[1], rows
    s0, s1 = (control_call(cluster.control(n), "node.status")["cpp"] for n in ("g0s0", "g0s1"))
    assert (s0["layers"], s1["layers"]) == ([0, 15], [15, 30])
    assert control_call(cluster.control("prefill0"), "node.status")["cpp"] is None


def test_cpp_output_equals_the_single_nodes(cluster):
    """Greedy and seeded-sampled output through the group = through prefill0 (the same
    prompt, the group drained the second time); the same prompt again on the group reuses
    every full block but the last token's (cached_tokens > 0) with the same output."""
    greedy = {"cache_salt": uuid.uuid4().hex}          # fresh: no node holds a prefix of it
    sampled = {"cache_salt": uuid.uuid4().hex, "temperature": 0.9, "seed": 11}
    s, greedy_cpp = complete(cluster, LONG, 12, **greedy)
    s2, sampled_cpp = complete(cluster, LONG, 8, **sampled)
    s3, again = complete(cluster, LONG, 12, **greedy)      # a prefix hit on every stage
    assert (s, s2, s3) == (200, 200, 200), (greedy_cpp, sampled_cpp, again)
    assert [prefilled_on(cluster, b) for b in (greedy_cpp, sampled_cpp, again)] == ["g0s0"] * 3
    assert greedy_cpp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert again["choices"][0]["text"] == greedy_cpp["choices"][0]["text"]
    set_draining(cluster, "g0s0", True)
    try:
        s, greedy_one = complete(cluster, LONG, 12, **greedy)
        s2, sampled_one = complete(cluster, LONG, 8, **sampled)
        assert (s, s2) == (200, 200), (greedy_one, sampled_one)
        assert [prefilled_on(cluster, b) for b in (greedy_one, sampled_one)] == ["prefill0"] * 2
    finally:
        set_draining(cluster, "g0s0", False)
    assert greedy_cpp["usage"]["completion_tokens"] == 12
    assert greedy_cpp["choices"][0]["text"] == greedy_one["choices"][0]["text"], (greedy_cpp,
                                                                                 greedy_one)
    assert sampled_cpp["choices"][0]["text"] == sampled_one["choices"][0]["text"], (sampled_cpp,
                                                                                   sampled_one)
    # a short prompt goes to the single node (below cpp_min_tokens)
    s, body = complete(cluster, SHORT, 4)
    assert s == 200 and prefilled_on(cluster, body) == "prefill0"


def test_structured_output_through_the_group_equals_the_single_nodes(cluster):
    """A constrained request (a regex the model would not follow unconstrained: its first
    token is masked on the last stage) runs on the group, greedy and seeded-sampled, with
    the same text as on prefill0 (group drained), and the text matches the pattern."""
    import re
    pattern = r"[0-9]{3}-[a-z]{4}\."
    so = {"structured_outputs": {"regex": pattern}}
    greedy = {"cache_salt": uuid.uuid4().hex, **so}
    sampled = {"cache_salt": uuid.uuid4().hex, "temperature": 0.9, "seed": 5, **so}
    s, g_cpp = complete(cluster, LONG, 12, **greedy)
    s2, x_cpp = complete(cluster, LONG, 12, **sampled)
    assert (s, s2) == (200, 200), (g_cpp, x_cpp)
    assert [prefilled_on(cluster, b) for b in (g_cpp, x_cpp)] == ["g0s0"] * 2
    set_draining(cluster, "g0s0", True)
    try:
        s, g_one = complete(cluster, LONG, 12, **greedy)
        s2, x_one = complete(cluster, LONG, 12, **sampled)
        assert (s, s2) == (200, 200), (g_one, x_one)
        assert [prefilled_on(cluster, b) for b in (g_one, x_one)] == ["prefill0"] * 2
    finally:
        set_draining(cluster, "g0s0", False)
    texts = [b["choices"][0]["text"] for b in (g_cpp, x_cpp, g_one, x_one)]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert texts[0] == texts[2] and texts[1] == texts[3], texts


def test_a_cpp_request_gets_its_prefix_from_the_pool(cluster):
    """A prompt whose head prefill0 prefilled (its store holds the head's full blocks) and
    whose tail is long: the conductor sends it to the group with prefill0 as the fetch
    source; each stage READs only its layers' bytes of those blocks (its share of the
    bytes), the reply reuses them (cached_tokens > 0) and the output equals prefill0's for
    the same prompt computed from scratch. Each stage then keeps the slices in its store,
    and the conductor's index has them."""
    salt = uuid.uuid4().hex
    head = " ".join(f"item{i}" for i in range(60))
    whole = head + " " + " ".join(f"other{i}" for i in range(60))

    def held() -> int:     # prefill0's stored blocks (the module's stores never evict)
        return control_call(cluster.control("prefill0"), "node.status")["store"]["dram_blocks"]
    before = held()
    set_draining(cluster, "g0s0", True)
    try:
        s1, first = complete(cluster, head, 4, cache_salt=salt)                 # blocks on prefill0
        s2, ref = complete(cluster, whole, 12, cache_salt=uuid.uuid4().hex)    # nothing cached
        assert (s1, s2) == (200, 200), (first, ref)
        assert [prefilled_on(cluster, b) for b in (first, ref)] == ["prefill0"] * 2
    finally:
        set_draining(cluster, "g0s0", False)
    head_blocks = first["usage"]["prompt_tokens"] // 16
    want = before + head_blocks + ref["usage"]["prompt_tokens"] // 16
    wait_until(lambda: held() >= want, WAIT_S, "prefill0 to store both prompts' blocks")
    # the conductor's index has them (prefill0's store events)
    wait_until(lambda: (cluster.status() or {}).get("nodes", {}).get("prefill0", {})
               .get("indexed_blocks", 0) == held(), WAIT_S, "the index to have prefill0's blocks")
    stats = [control_call(cluster.control(n), "node.status")["cpp"]["prefix"]
             for n in ("g0s0", "g0s1")]
    s, body = complete(cluster, whole, 12, cache_salt=salt)
    assert s == 200, body
    assert prefilled_on(cluster, body) == "g0s0"
    assert body["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == head_blocks * 16
    assert body["choices"][0]["text"] == ref["choices"][0]["text"], (body, ref)
    after = [control_call(cluster.control(n), "node.status")["cpp"] for n in ("g0s0", "g0s1")]
    for b, a in zip(stats, after):
        p = a["prefix"]
        share = a["block_bytes"] * (a["layers"][1] - a["layers"][0]) // a["num_layers"]
        assert p["fetched_blocks"] - b["fetched_blocks"] == head_blocks
        assert p["fetched_bytes"] - b["fetched_bytes"] == head_blocks * share   # its layers only
    # the slices (head and tail) reach the stages' stores and the conductor's index
    whole_blocks = body["usage"]["prompt_tokens"] // 16
    wait_until(lambda: all(control_call(cluster.control(n), "node.status")["cpp"]["prefix"]
                           ["slices"] >= whole_blocks for n in ("g0s0", "g0s1")),
               WAIT_S, "the stages to store their slices")
    wait_until(lambda: all((cluster.status() or {}).get("nodes", {}).get(n, {})
                           .get("indexed_blocks", 0) >= whole_blocks for n in ("g0s0", "g0s1")),
               WAIT_S, "the index to have the stages' slices")


def test_more_concurrent_requests_than_receive_slots_all_succeed(cluster):
    """RECEIVE_SLOTS + 3 requests at once on the group (prefill0 drained): stage 0 admits
    RECEIVE_SLOTS into the pipeline and queues the rest (it was a 502 for each request
    beyond the slots); every one answers 200 with the same greedy text."""
    from mooncaked.cluster.cpp.cpp_node import RECEIVE_SLOTS
    n = RECEIVE_SLOTS + 3
    out: list = [None] * n
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "temperature": 0}

    def one(i: int) -> None:
        out[i] = http("POST", f"{cluster.api_url('decode0')}/v1/completions",
                      {**body, "cache_salt": uuid.uuid4().hex})
    set_draining(cluster, "prefill0", True)
    try:
        idle(cluster)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
    finally:
        set_draining(cluster, "prefill0", False)
    assert all(r is not None for r in out), out
    assert [s for s, _ in out] == [200] * n, [b for _, b in out]
    assert len({b["choices"][0]["text"] for _, b in out}) == 1, [b for _, b in out]
    assert {prefilled_on(cluster, b) for _, b in out} == {"g0s0"}


def test_a_decode_refusal_comes_before_any_stage_computes(cluster):
    """A ~3,000-token prompt goes to the group, and decode0's TBT check refuses it (predicted
    step ~1.2 s > 1 s) when stage 0 asks it to admit the request, as a single prefill node
    asks: the client gets the 429 and no stage computed any of it (issue 31; the check came
    after the group's whole prefill before)."""
    prompt = " ".join(f"item{i}" for i in range(770))
    refused_before = control_call(cluster.control("decode0"), "node.status")["requests"]["refused"]
    s, body = complete(cluster, prompt, 4, cache_salt=uuid.uuid4().hex)
    assert s == 429, body
    assert body["error"]["code"] == "overloaded" and "tbt_slo" in body["error"]["message"], body
    assert control_call(cluster.control("decode0"), "node.status")["requests"]["refused"] \
        == refused_before + 1

    def done_line() -> dict | None:
        lines = [orjson.loads(ln) for ln in cluster.log_path("decode0").read_text().splitlines()
                 if '"request_done"' in ln]
        return next((r for r in reversed(lines) if r["prompt_tokens"] > 2500), None)
    line = wait_until(done_line, WAIT_S, "the refused request's request_done line")
    assert line["prefill"] == "g0s0" and line["output_tokens"] == 0, line
    # stage 0 logs cpp_prefill_done before it answers: a prefill computed before the
    # refusal would be in its log by now
    assert not [ln for ln in cluster.log_path("g0s0").read_text().splitlines()
                if '"cpp_prefill_done"' in ln and line["request_id"] in ln]
    # and the group serves the next request
    s, body = complete(cluster, LONG, 4, cache_salt=uuid.uuid4().hex)
    assert s == 200 and prefilled_on(cluster, body) == "g0s0", body


def test_a_group_alone_serves_short_prompts(cluster):
    set_draining(cluster, "prefill0", True)
    try:
        s, body = complete(cluster, SHORT, 4)
        assert s == 200 and body["usage"]["completion_tokens"] == 4, body
        assert prefilled_on(cluster, body) == "g0s0"
    finally:
        set_draining(cluster, "prefill0", False)


@pytest.mark.parametrize(("dead", "other", "rerun"), [("g0s1", "g0s0", True),
                                                       ("g0s0", "g0s1", False)])
def test_kill_of_a_stage_mid_request_is_rerun_or_a_clear_error_and_frees_everything(
        cluster, dead, other, rerun):
    """kill -9 of a stage while a long prompt is in the pipeline: with prefill0 live the
    request is re-run there (200; the API node logs stage 0's error naming the dead hop),
    with prefill0 drained the client gets a 503 naming the dead stage; either way the other
    stage and the decode node hold nothing of the request within a few seconds."""
    if not rerun:
        set_draining(cluster, "prefill0", True)
    result: dict = {}
    prompt = " ".join(f"entry{i}" for i in range(330))     # ~1,000 tokens: ~30 chunks
    t = threading.Thread(target=lambda: result.update(r=complete(cluster, prompt, 4)))
    try:
        t.start()
        wait_until(lambda: control_call(cluster.control("g0s1"), "node.status")["cpp"]["requests"],
                   WAIT_S, "the request to reach stage 1")
        cluster.kill(dead)
        t.join(WAIT_S)
        assert not t.is_alive()
        status, body = result["r"]
        if rerun:      # stage 0 answered StageFailure naming the hop; prefill0 ran it
            assert status == 200 and body["usage"]["completion_tokens"] == 4, body
            replaced = [orjson.loads(line) for line in cluster.log_path("decode0").read_text()
                        .splitlines() if '"prefill_replaced"' in line]
            assert any("CPP group g0 failed (the hop to stage 1 g0s1)" in r["reason"]
                       for r in replaced), replaced
        else:
            assert status == 503, body
            assert dead in body["error"]["message"], body

        def nothing_held() -> bool:
            s = control_call(cluster.control(other), "node.status")
            d = control_call(cluster.control("decode0"), "node.status")
            return (not s["cpp"]["requests"] and not s["cpp"]["stage_pages"]
                    and not s["requests"]["prefill"] and d["requests"]["receiving"] == 0
                    and not d["requests"]["decode"])
        def held() -> dict:   # what is still held, for the failure message
            s = control_call(cluster.control(other), "node.status")
            d = control_call(cluster.control("decode0"), "node.status")
            return {other: {"cpp_requests": s["cpp"]["requests"], "stage_pages": s["cpp"]["stage_pages"],
                            "prefill": s["requests"]["prefill"]},
                    "decode0": {k: d["requests"][k] for k in ("receiving", "decode")}}
        wait_until(nothing_held, FREE_S, f"{other} and the decode node to free the request", held)
    finally:
        t.join(WAIT_S)
        if not rerun:
            set_draining(cluster, "prefill0", False)
        cluster.restart_node(dead, READY_TIMEOUT_S)
    # the group serves again once the conductor has its restarted stage's record

    def served_by_group() -> bool:
        s, body = complete(cluster, LONG, 4, cache_salt=uuid.uuid4().hex)
        assert s == 200, body
        return prefilled_on(cluster, body) == "g0s0"
    wait_until(served_by_group, WAIT_S, "a request served by the group again")


ABORTS = 4            # after four leaked slots the group was dead (issue 32, fault 4)
HELD_S = HELD_IDLE_FACTOR * 2.0     # cpp.idle_timeout_s = 2 here


def test_client_aborts_during_a_cpp_prefill_free_every_stage_and_the_group_serves(cluster):
    """Issue 32, fault 4: a client that closes its stream while the group prefills a long
    prompt frees the request on every stage and on the decode node (stage 1 used to keep
    it, held by stage 0's never-dropped cpp.hold, until its slots ran out), four times
    over; then the group still serves."""
    prompt = " ".join(f"entry{i}" for i in range(330))     # ~1,000 tokens: ~30 chunks
    url = urllib.parse.urlsplit(cluster.api_url("decode0"))
    body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                         "stream": True, "cache_salt": uuid.uuid4().hex})

    def held() -> dict:
        st = {n: control_call(cluster.control(n), "node.status") for n in ("g0s0", "g0s1")}
        d = control_call(cluster.control("decode0"), "node.status")
        return {**{n: (s["cpp"]["requests"], s["cpp"]["stage_pages"], s["cpp"]["free_slots"])
                   for n, s in st.items()},
                "decode0": (d["requests"]["receiving"], d["requests"]["decode"])}

    def nothing_held() -> bool:
        h = held()
        return (all(not h[n][0] and not h[n][1] for n in ("g0s0", "g0s1"))
                and h["decode0"][0] == 0 and not h["decode0"][1])
    def held_idle_releases() -> int:
        return cluster.log_path("g0s1").read_text().count('"reason":"held idle"')
    before = held_idle_releases()
    for i in range(ABORTS):
        idle(cluster)
        conn = HTTPConnection(url.hostname, url.port, timeout=WAIT_S)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            wait_until(lambda: control_call(cluster.control("g0s1"), "node.status")["cpp"]
                       ["requests"], WAIT_S, f"abort {i}: the request to reach stage 1")
        finally:
            conn.sock.shutdown(socket.SHUT_RDWR)            # the client goes away mid-prefill
            conn.close()
        # at the latest a held request's backstop (HELD_IDLE_FACTOR idle timeouts: 12 s here)
        wait_until(nothing_held, HELD_S + FREE_S, f"abort {i}: every stage and decode0 to "
                   f"free it", held)
    # ... but in fact at once, through the dropped holds: no stage gave one up at its
    # backstop (each abort took 12 s that way before stage 0 told a cancelled result from a
    # finished one)
    assert held_idle_releases() == before, "stage 1 freed an aborted request only at its backstop"
    s, out = complete(cluster, LONG, 4, cache_salt=uuid.uuid4().hex)
    assert s == 200 and out["usage"]["completion_tokens"] == 4, out
    assert prefilled_on(cluster, out) == "g0s0"


def test_constrained_logprobs_through_the_group_are_numbers(cluster):
    """Issue 32, fault 1 on CPP: the last stage's logprobs of a grammar-constrained first
    token (masked alternatives: -inf) cross the stages and nodes in their wire form; the
    client gets numbers, -9999.0 for the masked ones (a 500 before)."""
    body = {**CONSTRAINED_LOGPROBS["completions-choice"], "cache_salt": uuid.uuid4().hex}
    body["prompt"] = LONG + " " + body["prompt"]      # long enough for the group
    s, out = complete(cluster, body.pop("prompt"), body.pop("max_tokens"), **body)
    assert s == 200, out
    assert prefilled_on(cluster, out) == "g0s0"
    vals = logprob_values(out)
    assert -9999.0 in vals and out["choices"][0]["text"] in ("yes", "no"), out


def test_a_wedged_group_is_stalled_in_ctl_and_the_conductor_and_not_placed_on(cluster):
    """Issue 32: a group whose stage cannot take requests (here every receive slot of g0s1
    reserved and held by a caller that sends nothing: leaked slots) shows as stalled in the
    conductor's view and in `mooncake ctl status`, and a long prompt, the group's by cost,
    goes to prefill0 meanwhile; once the slots are freed the group serves again. (Stage 1
    gives such held requests up after HELD_IDLE_FACTOR idle timeouts, 12 s here: the
    checks run inside that window.)"""
    s1 = cluster.control("g0s1")
    rids = [f"wedge-{uuid.uuid4().hex}" for _ in range(4)]          # RECEIVE_SLOTS

    def stalled() -> dict:
        return ((cluster.status() or {}).get("cpp_groups") or {}).get("stalled") or {}
    for rid in rids:
        control_call(s1, "cpp.reserve", {"request_id": rid, "num_tokens": 64})
    holds = [threading.Thread(target=lambda r=rid: _quietly(control_call, s1, "cpp.hold",
                                                            {"request_id": r}, timeout_s=30),
                              daemon=True) for rid in rids]
    for t in holds:
        t.start()
    try:
        why = wait_until(lambda: stalled().get("g0"), HELD_S, "the conductor to see g0 stalled")
        assert list(why) == ["g0s1"] and "no free receive slot (4 held)" in why["g0s1"], why
        out = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "-c",
                              str(cluster.write_ctl_config())], capture_output=True, text=True,
                             timeout=120, check=False)
        rows = [line for line in out.stdout.splitlines() if "g0s1" in line and " g0 " in line]
        assert len(rows) == 1 and "stalled" in rows[0], out.stdout
        s, body = complete(cluster, LONG, 2, cache_salt=uuid.uuid4().hex)
        assert s == 200, body
        assert prefilled_on(cluster, body) == "prefill0"
        assert stalled().get("g0"), "the window closed before the checks ended"
    finally:
        for rid in rids:
            _quietly(control_call, s1, "cpp.release", {"request_id": rid})
    wait_until(lambda: not stalled(), WAIT_S, "g0 to take requests again")
    s, body = complete(cluster, LONG, 2, cache_salt=uuid.uuid4().hex)
    assert s == 200 and prefilled_on(cluster, body) == "g0s0", body


def test_prompt_logprobs_on_a_group_are_a_400(cluster):
    """A CPP group's last stage samples one row: prompt logprobs are refused with a 400
    naming prompt_logprobs, and the group keeps serving."""
    s, out = complete(cluster, LONG, 0, echo=True, logprobs=1, cache_salt=uuid.uuid4().hex)
    assert s == 400 and out["error"]["param"] == "prompt_logprobs", out


def _quietly(fn, *args, **kw):
    """fn(*args, **kw), its errors ignored (a hold ends with its release)."""
    try:
        return fn(*args, **kw)
    except (OSError, RuntimeError):
        return None
