"""A cluster of hosts on one machine (issue 34): every node and etcd in a network namespace
of its own on a private bridge, links shaped to 1gbit (cluster/hosts.py,
LocalCluster(hosts=True), what `mooncake up --hosts --link-rate 1gbit` starts), and
partitions that heal.

One shared cluster for the module (etcd, cache0 = the API node, prefill0, decode0; cache0
starts first and so leads; cache0's store is the largest, the pool's, and the conductor
replicates a prefix onto it once two nodes hold it; decode0 takes failpoints), and a
`--role all` reference process for greedy outputs. Every test starts on a whole cluster
(the autouse fixture heals every cut and waits until every node is ready again), so the
tests run in any order. Bounds: PLACEMENT_WAIT_S for a request that finds no conductor,
UNHEALTHY_BOUND_S for a node cut from etcd to answer /health 503, CUT_KV_BOUND_S and
CUT_FETCH_BOUND_S for a request across a cut link, REJOIN_BOUND_S for a healed cluster to
serve again. Needs root and etcd.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mooncaked.coord.etcd_server import etcd_binary
from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call

from cluster_harness import run_server, wait_until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed "
                       "(mooncaked/cluster/install_etcd.sh)"),
]

READY_TIMEOUT_S = 300.0          # three model loads on two shared cores
LEASE_TTL_S = 2.0
OP_TIMEOUT_S = 1.0
PLACEMENT_WAIT_S = 2.0
UNHEALTHY_BOUND_S = LEASE_TTL_S + 2 * OP_TIMEOUT_S + 2.0     # session lost + a health poll
TRANSFER_TIMEOUT_S = 5.0
STREAM_IDLE_S = 8.0
# a request whose decode node is cut from its prefill node ends within this (well under
# server.request_timeout_s): the push reservation (rpc_timeout_s), the READ it falls back to
# (TRANSFER_TIMEOUT_S), a re-placement that finds no other node (PLACEMENT_WAIT_S). Observed
# 34 s on the loaded two-core machine, about 25 s of it before the decode node's READ
# starts (when the decode node also leads, the prefill node is cut from the conductor too)
CUT_KV_BOUND_S = 60.0
# a request whose prefix source is cut from its prefill node: the fetch's lease call times
# out (rpc_timeout_s; the fetch is bounded by rpc_timeout_s + TRANSFER_TIMEOUT_S), then the
# prefill recomputes the prefix (a few seconds on the loaded two-core machine)
CUT_FETCH_BOUND_S = 45.0
REJOIN_BOUND_S = 60.0
# reports every second: a node cut from the conductor for a failed READ (5 s) is still live
# to it (stale after 8 reports), so the request placed again after the heal finds it
REPORT_INTERVAL_S = 1.0
NODES = ("cache0", "prefill0", "decode0")
MOONCAKE = str(Path(sys.executable).parent / "mooncake")
# about 650 tokens: its KV (46 KB a token) is what the prefill pushes to the decode node
PROMPT = "Inventory: " + ", ".join(f"box {i} holds {i * 7 % 13} red pens" for i in range(60))


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0
         ) -> tuple[int, dict]:
    """(status, JSON body) of one request; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def complete(url: str, prompt: str = PROMPT, timeout: float = 120.0) -> tuple[int, dict]:
    return http("POST", f"{url}/v1/completions",
                {"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout)


def stream(url: str, prompt: str, timeout: float = 120.0) -> tuple[int, str, dict | None]:
    """(status, the text streamed, the error: an error event's or the error body) of one
    streamed greedy completion of 12 tokens."""
    req = urllib.request.Request(
        f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0,
                         "stream": True}).encode())
    text, err = "", None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue                         # blank separators, data: [DONE]
                event = json.loads(line[6:])
                if "error" in event:
                    err = event
                else:
                    text += event["choices"][0]["text"]
            return r.status, text, err
    except urllib.error.HTTPError as e:
        return e.code, text, json.loads(e.read() or b"{}")


def reference(url: str, prompt: str) -> str:
    """The `--role all` process's greedy text of `prompt`."""
    status, body = complete(url, prompt)
    assert status == 200, body
    return body["choices"][0]["text"]


def kv_counters(cluster: LocalCluster, nid: str) -> dict:
    """node.status "kv_transfer" of a node (fetches, fetch_failed, read, ...)."""
    return control_call(cluster.control(nid), "node.status", timeout_s=5.0)["kv_transfer"]


def failpoint(cluster: LocalCluster, nid: str, name: str, action: str | None = None,
              **kw) -> dict:
    """Sets failpoint `name` on a node (action given), or reads it; its state."""
    payload = {"name": name, **({"action": action} if action else {}), **kw}
    return control_call(cluster.control(nid), "debug.failpoint", payload,
                        timeout_s=5.0)["failpoints"].get(name, {})


def node_status(cluster: LocalCluster, nid: str) -> dict | None:
    try:
        return control_call(cluster.control(nid), "node.status", timeout_s=2.0)
    except (OSError, RuntimeError):
        return None


def health(cluster: LocalCluster, nid: str) -> int:
    return http("GET", f"{cluster.api_url(nid)}/health", timeout=3.0)[0]


def events(cluster: LocalCluster, nid: str, event: str, since: float) -> list[float]:
    """Timestamps (wall clock, one machine) of a node's log event after `since`."""
    out = []
    for line in cluster.log_path(nid).read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event and rec.get("ts", 0) >= since:
            out.append(rec["ts"])
    return out


def ctl_config(cluster: LocalCluster) -> Path:
    """The cluster's `mooncake ctl -c` file with a 10 s store timeout: the nodes' 1 s
    (OP_TIMEOUT_S, for quick failover) is too short for a one-shot CLI on a loaded 2-core
    machine (a `ctl nodes` lease grant timed out in CI)."""
    path = cluster.write_ctl_config()
    text = path.read_text()
    slow = text.replace(f"op_timeout_s = {OP_TIMEOUT_S}", "op_timeout_s = 10.0")
    assert slow != text, text
    path.write_text(slow)
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(cluster, reference URL, greedy reference text of PROMPT)."""
    tmp = tmp_path_factory.mktemp("hosts_cluster")
    settings = {"cluster.lease_ttl_s": LEASE_TTL_S, "cluster.heartbeat_interval_s": 0.5,
                "cluster.op_timeout_s": OP_TIMEOUT_S, "cluster.rpc_timeout_s": 2.0,
                "cluster.placement_wait_s": PLACEMENT_WAIT_S, "cluster.drain_timeout_s": 2.0,
                "engine.kv_cache_bytes": 64 << 20, "store.dram_bytes": 32 << 20,
                "conductor.ttft_slo_s": 600.0, "conductor.tbt_slo_s": 600.0,
                "server.request_timeout_s": 120.0,
                "transfer.request_timeout_s": TRANSFER_TIMEOUT_S,
                "cluster.stream_idle_timeout_s": STREAM_IDLE_S,
                "cluster.report_interval_s": REPORT_INTERVAL_S,
                # a prefix the prefill and decode nodes hold is still copied onto cache0
                "conductor.hot_block_replicas": 3}
    cl = LocalCluster(tmp, [NodeSpec("cache", "cache0", settings={"store.dram_bytes": 256 << 20}),
                            NodeSpec("prefill", "prefill0"),
                            NodeSpec("decode", "decode0", env={"MOONCAKED_FAILPOINTS": ""})],
                      backend="etcd", settings=settings, hosts=True, link_rate="1gbit")
    made: set[str] = set()
    try:
        cl.start_backend()
        made = {h.netns for h in cl.hosts.hosts.values()}
        cl.start_node("cache0")
        cl.wait_ready(READY_TIMEOUT_S, nodes=["cache0"])   # first to campaign: it leads
        cl.start_node("prefill0")
        cl.start_node("decode0")
        (tmp / "ref").mkdir()
        with run_server(tmp / "ref") as ref:
            cl.wait_ready(READY_TIMEOUT_S)
            status, body = complete(ref.url)
            assert status == 200, body
            yield cl, ref.url, body["choices"][0]["text"]
    finally:
        cl.stop()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cl.hosts is None and not made & {ln.split()[0] for ln in left.splitlines()}


@pytest.fixture(autouse=True)
def whole(env):
    """Each test starts (and leaves) with no cut and every node ready under one leader."""
    cluster = env[0]
    cluster.hosts.heal()
    wait_until(lambda: all(health(cluster, n) == 200 for n in NODES), REJOIN_BOUND_S,
               "every node /health 200")
    cluster.wait_ready(REJOIN_BOUND_S)
    yield
    cluster.hosts.heal()


def leader(cluster: LocalCluster) -> str:
    return wait_until(lambda: (node_status(cluster, "prefill0") or {}).get("leader"), 10,
                      "a leader")


def test_nodes_bind_and_advertise_their_hosts_addresses_and_measure_their_links(env):
    cluster, _, ref = env
    hosts = cluster.hosts
    addrs = {n: hosts.address(n) for n in NODES}
    assert len(set(addrs.values())) == 3 and all(a.startswith("10.") for a in addrs.values())
    assert cluster.etcd.endpoint.startswith(f"http://{hosts.address('etcd')}:")
    for n in NODES:                   # the API is reached from the root namespace
        assert cluster.api_url(n).startswith(f"http://{addrs[n]}:")
    # what the nodes registered: every address is the node's host's
    out = subprocess.run([MOONCAKE, "ctl", "nodes", "--json",
                          "-c", str(ctl_config(cluster))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reg = json.loads(out.stdout)
    for n in NODES:
        info = reg[n]["info"]
        assert info["api"].startswith(f"http://{addrs[n]}:"), info
        assert info["control"].startswith(f"{addrs[n]}:"), info
        assert info["transfer"]["host"] == addrs[n], info

    status, body = complete(cluster.api_url("cache0"))
    assert status == 200, body
    assert body["choices"][0]["text"] == ref        # greedy: equal to one process

    # the KV push crossed the shaped link: the engines measured it, the conductor uses it
    def measured():
        st = cluster.status() or {}
        links = {n: v.get("links") for n, v in (st.get("nodes") or {}).items() if v.get("links")}
        return (links, st["transfer_bandwidth"]) if links else None
    links, bw = wait_until(measured, 60, "a measured link in the conductor's status")
    rates = [r for paths in links.values() for r in paths.values()]
    # a 1gbit link moves 125 MB/s; loopback would read several GB/s (the tbf burst lets a
    # short push run ahead of the rate, hence the slack)
    assert all(0 < r < 2.5 * 125e6 for r in rates), links
    # the rate the conductor places with (a conductor loads its cost model at its first
    # placement; on a loaded machine the leader may have changed since: place once more)
    def used():
        complete(cluster.api_url("cache0"), "Hi")
        b = (cluster.status() or {}).get("transfer_bandwidth") or {}
        return b if b.get("used_bytes_per_s") and b.get("measured_paths") else None
    bw = wait_until(used, 60, "the conductor placing with the measured rate")
    assert bw["used_bytes_per_s"] < 2.5 * 125e6, bw
    assert bw["used_bytes_per_s"] != bw["configured_bytes_per_s"], bw
    out = subprocess.run([MOONCAKE, "ctl", "status",
                          "-c", str(ctl_config(cluster))],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    # the rate as ctl prints it: Mbit/s below 1 Gbit/s, Gbit/s above (the tbf burst can let
    # a short push read above the link's 1 Gbit/s, within the 2.5x slack asserted above)
    # "median of 1 measured path" or "of 2 measured paths": how many links were measured
    # by then varies with the run
    assert out.returncode == 0, out.stderr
    assert re.search(r"median of [1-9]\d* measured paths?;", out.stdout), out.stdout
    assert "Mbit/s" in out.stdout or "Gbit/s" in out.stdout, out.stdout


def test_api_node_cut_from_the_conductor_waits_placement_wait_then_503(env):
    cluster, _, ref = env
    lead = leader(cluster)
    api = next(n for n in ("prefill0", "decode0", "cache0") if n != lead)
    cluster.hosts.cut(api, lead)
    t0 = time.monotonic()
    status, body = complete(cluster.api_url(api), timeout=30)
    elapsed = time.monotonic() - t0
    assert status == 503, body
    assert body["error"]["code"] == "no_conductor"
    assert PLACEMENT_WAIT_S - 0.2 <= elapsed <= PLACEMENT_WAIT_S + 1.5, elapsed
    cluster.hosts.heal()
    status, body = wait_until(lambda: (r := complete(cluster.api_url(api)))[0] == 200 and r,
                              REJOIN_BOUND_S, "served again after the heal")
    assert body["choices"][0]["text"] == ref


def test_leader_cut_from_etcd_stands_down_and_a_new_leader_takes_over(env):
    cluster, _, ref = env
    old = leader(cluster)
    others = [n for n in NODES if n != old]
    since = time.time()
    # the leader on the minority side: cut from etcd and every other node, not from us
    cluster.hosts.partition([old], ["etcd", *others])
    t0 = time.monotonic()
    wait_until(lambda: health(cluster, old) == 503, UNHEALTHY_BOUND_S,
               f"{old} /health 503 once cut from etcd")
    unhealthy_s = time.monotonic() - t0
    # its API refuses (bounded) rather than hanging
    t1 = time.monotonic()
    status, body = complete(cluster.api_url(old), timeout=30)
    assert status == 503, body
    assert time.monotonic() - t1 <= PLACEMENT_WAIT_S + 1.5
    # the majority elects a new leader
    new = wait_until(lambda: next((st["leader"] for n in others
                                   if (st := node_status(cluster, n) or {}).get("leader")
                                   and st["leader"] != old), None),
                     LEASE_TTL_S + 15, "a new leader on the majority side")
    assert new in others
    # no two conductors placed at once: the old one stood down before the new one started
    lost = wait_until(lambda: events(cluster, old, "conductor_leadership_lost", since), 10,
                      "the old leader's conductor_leadership_lost")
    started = wait_until(lambda: events(cluster, new, "conductor_started", since), 10,
                         "the new leader's conductor_started")
    assert max(lost) < min(started), (lost, started)
    cluster.hosts.heal()
    # the old leader rejoins as a follower of the new one, without a restart
    wait_until(lambda: health(cluster, old) == 200, REJOIN_BOUND_S, f"{old} healthy again")
    assert (node_status(cluster, old) or {}).get("leader") == new
    assert cluster.procs[old].poll() is None
    status, body = wait_until(lambda: (r := complete(cluster.api_url(old)))[0] == 200 and r,
                              REJOIN_BOUND_S, "served again after the heal")
    assert body["choices"][0]["text"] == ref
    print(f"{old} unhealthy after {unhealthy_s:.2f} s (bound {UNHEALTHY_BOUND_S} s); "
          f"stood down at {max(lost):.3f}, {new} started at {min(started):.3f}")


def wait_decode0_idle(cluster) -> None:
    """Waits (at most 30 s) until the conductor sees decode0 idle: it counts a finished
    request on decode0 until decode0's next report names it, and placing before that may
    find decode0 full (429 decode_full, seen in CI)."""
    def idle() -> bool:
        v = ((cluster.status() or {}).get("nodes") or {}).get("decode0") or {}
        return v.get("inflight") == 0 and v.get("decode_batch") == 0
    wait_until(idle, 30, "the conductor to see decode0 idle", interval_s=REPORT_INTERVAL_S / 4)


def test_decode_cut_from_prefill_fails_the_request_in_bounded_time_then_heals(env):
    """The KV hand-over crosses a cut link: the layer-wise push cannot reserve, the READ it
    falls back to times out; with no other decode node the request ends with an OpenAI
    error (never a hang, never output from partial KV); healed, the same prompt gives
    the reference output again."""
    cluster, _, ref = env
    wait_decode0_idle(cluster)      # a 429 decode_full from the last test's request, once in CI
    cluster.hosts.cut("prefill0", "decode0")
    t0 = time.monotonic()
    cut_status, body = complete(cluster.api_url("cache0"),
                                PROMPT.replace("red pens", "blue pens"), timeout=120)
    elapsed = time.monotonic() - t0
    # a clear error in bounded time: the transfer's failure. (A 429 decode_full seen once
    # came from the conductor counting the request's own first placement when it placed it
    # again: fixed, load.decode_load_during.)
    assert cut_status in (502, 503, 504), (cut_status, body)
    assert body["error"]["message"] and body["error"]["type"], body
    assert elapsed <= CUT_KV_BOUND_S, elapsed
    assert all(cluster.procs[n].poll() is None for n in NODES)
    cluster.hosts.heal()
    status, body = wait_until(lambda: (r := complete(cluster.api_url("cache0")))[0] == 200 and r,
                              REJOIN_BOUND_S, "served again after the heal")
    assert body["choices"][0]["text"] == ref
    print(f"decode cut from prefill: {cut_status} after {elapsed:.1f} s (bound {CUT_KV_BOUND_S} s)")


def test_decode_cut_from_prefill_during_a_read_resumes_after_the_heal(env):
    """The pull path: decode0 refuses the push (failpoint node.kv_reserve), so it READs the
    staged KV; its READ is held (decode.kv_read) while the link to prefill0 is cut, then
    runs across the cut and fails at transfer.request_timeout_s: decode0 never decodes
    from partial KV. The client already has the first token; the API node places the
    request again (prompt + that token) and, the link healed meanwhile, the stream ends
    with the single process's greedy text, within a stated bound, no node restarted."""
    cluster, ref_url, _ = env
    prompt = PROMPT.replace("red pens", "black cards")
    want = reference(ref_url, prompt)
    before = kv_counters(cluster, "decode0")
    since = time.time()
    failpoint(cluster, "decode0", "node.kv_reserve", "error", times=1)
    failpoint(cluster, "decode0", "decode.kv_read", "pause", times=1)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(stream, cluster.api_url("cache0"), prompt)
        wait_until(lambda: failpoint(cluster, "decode0", "decode.kv_read").get("fired")
                   or fut.done(), 120, "decode0 holding its READ of the staged KV")
        assert not fut.done(), fut.result()
        cluster.hosts.cut("prefill0", "decode0")
        t0 = time.monotonic()
        failpoint(cluster, "decode0", "decode.kv_read", "off")      # the READ crosses the cut
        wait_until(lambda: events(cluster, "decode0", "kv_read_failed", since) or fut.done(),
                   TRANSFER_TIMEOUT_S + 10, "decode0's READ failing across the cut")
        read_failed_s = time.monotonic() - t0
        cluster.hosts.heal()
        status, text, err = fut.result(timeout=CUT_KV_BOUND_S)
        elapsed = time.monotonic() - t0
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            failpoint(cluster, "decode0", "decode.kv_read", "off")
            failpoint(cluster, "decode0", "node.kv_reserve", "off")
        pool.shutdown(wait=False, cancel_futures=True)
    assert (status, err) == (200, None), (status, text, err)
    assert text == want                          # the resumed stream: one process's output
    assert elapsed <= CUT_KV_BOUND_S, elapsed
    assert events(cluster, "decode0", "kv_read_failed", since)
    assert "could not read the KV staged" in cluster.log_tail("cache0", 400_000)
    after = kv_counters(cluster, "decode0")
    assert after["read"] > before["read"]        # the pull path ran (after the heal)
    assert all(cluster.procs[n].poll() is None for n in NODES)
    print(f"READ across the cut failed after {read_failed_s:.1f} s; the request ended "
          f"{elapsed:.1f} s after the cut (bound {CUT_KV_BOUND_S} s)")


def test_cache_node_cut_while_it_is_the_source_of_a_fetch_the_prefill_recomputes(env):
    """A prefix only cache0 holds (replicated there as hot, then evicted from prefill0 and
    decode0 by other prompts) is placed as a fetch from cache0; cache0 is cut from
    prefill0 meanwhile: the fetch fails within its bound, prefill0 recomputes, and the
    stream (through decode0's API) is the single process's greedy text."""
    cluster, ref_url, _ = env
    prompt = PROMPT.replace("red pens", "green inks")
    want = reference(ref_url, prompt)
    held = (control_call(cluster.control("cache0"), "node.status", timeout_s=5.0)
            ["store"]["dram_blocks"])
    # used twice, the prefix is hot and the conductor copies it onto cache0 from a node
    # its index knows to hold it (prefill0's store events come in its next report, so the
    # second use may find no holder yet: the prompt is sent again until cache0 holds it,
    # every answer the single process's)
    def replicated() -> int:
        wait_decode0_idle(cluster)      # else a 429 decode_full (the previous use counted)
        assert stream(cluster.api_url("cache0"), prompt)[:2] == (200, want)
        n = (control_call(cluster.control("cache0"), "node.status", timeout_s=5.0)
             ["store"]["dram_blocks"] - held)
        return n if n >= 30 else 0
    blocks = wait_until(replicated, 60, "the prompt's blocks replicated onto cache0",
                        state=lambda: (cluster.status() or {}).get("replication"),
                        interval_s=REPORT_INTERVAL_S)
    # other prompts push it out of prefill0's pages and store (and decode0's store); half
    # as long as PROMPT, so that two fit in decode0's KV: the conductor counts a finished
    # request until decode0's next report names it
    for i in range(4):
        wait_decode0_idle(cluster)
        r = stream(cluster.api_url("cache0"),
                   PROMPT[:len(PROMPT) // 2].replace("red pens", f"filler {i} cups"))
        assert r[0] == 200, r
    wait_decode0_idle(cluster)
    before = kv_counters(cluster, "prefill0")
    since = time.time()
    cluster.hosts.cut("cache0", "prefill0")
    t0 = time.monotonic()
    status, text, err = stream(cluster.api_url("decode0"), prompt, timeout=CUT_FETCH_BOUND_S + 30)
    elapsed = time.monotonic() - t0
    after = kv_counters(cluster, "prefill0")
    assert (status, err) == (200, None), (status, text, err)
    assert text == want                                    # recomputed: same output
    assert elapsed <= CUT_FETCH_BOUND_S, elapsed
    # the placement fetched from cache0; the fetch failed; nothing was fetched
    assert after["fetches"] - before["fetches"] == 1, (before, after)
    assert after["fetch_failed"] - before["fetch_failed"] == 1, (before, after)
    assert after["fetched_blocks"] == before["fetched_blocks"], (before, after)
    assert events(cluster, "prefill0", "prefix_fetch_failed", since)
    cluster.hosts.heal()
    status, text, err = wait_until(
        lambda: (r := stream(cluster.api_url("cache0"), prompt))[0] == 200 and r,
        REJOIN_BOUND_S, "served again after the heal")
    assert text == want
    assert all(cluster.procs[n].poll() is None for n in NODES)
    print(f"fetch source cut: {blocks} blocks on cache0; served in {elapsed:.1f} s "
          f"(bound {CUT_FETCH_BOUND_S} s)")
