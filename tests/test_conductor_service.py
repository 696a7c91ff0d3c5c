"""The live conductor's bookkeeping around Algorithm 1: load from reports, placements in
flight between reports, early rejection, excluded/draining/stale nodes, decode-only
re-placement, the global index fed by reported store events, and the prefill refit.

The service is driven through its RPC handlers (`report`, `place`, `status`) without a
coordinator: membership only matters to `start()`, which the e2e tests cover.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import dataclasses
import statistics
import time

from mooncaked.conductor.cost_model import CostModel, PolyModel, TransferModel
from mooncaked.wire.messages import NodeReport, PlaceRequest
from mooncaked.conductor.refit import CALIBRATE_EVERY
from mooncaked.conductor.service import INFLIGHT_TTL_S, ConductorService
from mooncaked.config import Settings

COST = CostModel(prefill=PolyModel(((0, 0), (1, 0)), (0.1, 0.01)),      # 0.1 s + 10 ms a token
                 decode=PolyModel(((0, 0), (1, 0)), (0.05, 0.01)),
                 transfer=TransferModel(1e9), kv_bytes_per_token=1000)


def service(ttft_slo: float = 3.0, min_retry_after_s: float = 1.0) -> ConductorService:
    s = Settings()
    s.conductor.ttft_slo_s = ttft_slo
    s.conductor.min_retry_after_s = min_retry_after_s
    s.conductor.tbt_slo_s = 1.0
    s.engine.block_size = 16
    return ConductorService("c1", None, None, s, cost=COST)


def report(svc: ConductorService, node: str, role: str, **kw) -> None:
    payload = {"node": node, "role": role, "pending": {}, "arrived": [],
               "decode": {"rids": [], "batch": 0, "context_tokens": 0, "free_kv_tokens": 10_000}}
    payload.update(kw)
    asyncio.run(svc.report(NodeReport.from_json(payload)))      # through the wire form


def place(svc: ConductorService, rid: str, n: int = 100, keys: list[bytes] = (), **kw) -> dict:
    req = PlaceRequest.from_json({"rid": rid, "keys": [k.hex() for k in keys],
                                  "prompt_tokens": n, "max_new_tokens": 10, **kw})
    return asyncio.run(svc.place(req)).to_json()


def test_placements_between_reports_queue_up_until_rejected():
    # each request predicts 0.1 + 100 * 0.01 = 1.1 s of prefill; nothing reported in between
    svc = service(ttft_slo=3.0)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    a, b = place(svc, "a"), place(svc, "b")
    assert a["ok"] and b["ok"] and a["prefill"]["node"] == "p1" and a["decode"]["node"] == "d1"
    # (a reported running prefill decays with the seconds since the report: ms here)
    assert [a["predicted_ttft_s"], b["predicted_ttft_s"]] == pytest.approx([1.1, 2.2], abs=0.01)
    rej = place(svc, "c")
    assert not rej["ok"] and rej["reason"] == "ttft_slo"
    # Retry-After: max(min_retry_after_s, predicted - SLO) = max(1.0, 3.3 - 3.0)
    assert rej["retry_after_s"] == 1.0 and abs(rej["predicted_ttft_s"] - 3.3) < 1e-9
    assert svc.status()["rejected"] == {"ttft_slo": 1}
    # the node's report now lists a and b as pending: no double counting with in-flight
    report(svc, "p1", "prefill", pending={"a": [100, 0], "b": [100, 0]}, arrived=["a", "b"])
    assert svc.status()["nodes"]["p1"]["queue_s"] == pytest.approx(2.2, abs=0.01)
    # ... and once they are done the queue is empty again
    report(svc, "p1", "prefill")
    assert place(svc, "c")["predicted_ttft_s"] == 1.1


def test_retry_after_is_the_predicted_excess_over_the_slo_above_the_minimum():
    svc = service(ttft_slo=3.0, min_retry_after_s=0.1)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    assert place(svc, "a")["ok"] and place(svc, "b")["ok"]
    rej = place(svc, "c")                                 # predicts 3.3 s against 3.0 s
    assert not rej["ok"] and abs(rej["retry_after_s"] - 0.3) < 1e-9


def test_inflight_placements_expire_without_a_report():
    svc = service()
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    place(svc, "lost")                   # its prefill call never reached p1
    v = svc.nodes["p1"]
    rid, inflight = next(iter(v.inflight_prefill.items()))
    v.inflight_prefill[rid] = dataclasses.replace(
        inflight, placed_at=inflight.placed_at - INFLIGHT_TTL_S - 1)
    report(svc, "p1", "prefill")
    assert not v.inflight_prefill


def test_a_decode_placement_stays_counted_until_its_predicted_prefill_is_over():
    # 100 tokens predict 1.1 s of prefill; with 19 queued ahead of it on p1 the request's
    # predicted TTFT is 20 * 1.1 = 22 s. The decode node hears of it only after its
    # prefill, so d1's reports must not drop it before then, and the next placement
    # must still see it on d1 (it goes to d2 then): its 100 output tokens (some 6 s) are
    # predicted to still decode when the next request's first token comes.
    svc = service(ttft_slo=100.0)
    report(svc, "p1", "prefill", pending={f"q{i}": [100, 0] for i in range(19)})
    report(svc, "d1", "decode")
    report(svc, "d2", "decode")
    r = place(svc, "long", max_new_tokens=100)
    assert r["ok"] and abs(r["predicted_ttft_s"] - 22.0) < 0.01
    d = r["decode"]["node"]
    e = svc.nodes[d].inflight_decode["long"]
    assert abs(e.expires_at - e.placed_at - (r["predicted_ttft_s"] + INFLIGHT_TTL_S)) < 1e-9
    # a report from that decode node after the fixed TTL, long before the predicted TTFT
    svc.nodes[d].inflight_decode["long"] = dataclasses.replace(
        e, placed_at=e.placed_at - INFLIGHT_TTL_S - 1, expires_at=e.expires_at - INFLIGHT_TTL_S - 1)
    report(svc, d, "decode")
    assert "long" in svc.nodes[d].inflight_decode
    other = place(svc, "next")
    assert other["ok"] and other["decode"]["node"] != d
    # past its expiry, a report that does not name it drops it
    e = svc.nodes[d].inflight_decode["long"]
    svc.nodes[d].inflight_decode["long"] = dataclasses.replace(e, expires_at=time.monotonic() - 1)
    report(svc, d, "decode")
    assert "long" not in svc.nodes[d].inflight_decode


def test_a_running_prefill_counts_only_the_work_it_has_left():
    # p1 reports "a" (1.1 s) computing and "b" (1.1 s) waiting. "a" was first listed 0.5 s
    # ago: 0.6 s of it is left, so a new request waits 0.6 + 1.1 and computes 1.1 s. Once
    # "a" is past its predicted cost (a report may still list it), it counts 0, not less.
    svc = service(ttft_slo=100.0)
    report(svc, "p1", "prefill", pending={"a": [100, 0], "b": [100, 0]}, waiting=["b"])
    report(svc, "d1", "decode")
    v = svc.nodes["p1"]
    assert set(v.prefill_running_since) == {"a"}
    v.prefill_running_since["a"] -= 0.5
    assert place(svc, "new")["predicted_ttft_s"] == pytest.approx(0.6 + 1.1 + 1.1, abs=0.01)
    v.prefill_running_since["a"] -= 5.0
    assert place(svc, "new2")["predicted_ttft_s"] == pytest.approx(1.1 + 1.1 + 1.1, abs=0.01)
    # the next report that lists "a" keeps when it was first listed
    report(svc, "p1", "prefill", pending={"a": [100, 0], "b": [100, 0]}, waiting=["b"])
    assert time.monotonic() - v.prefill_running_since["a"] > 5.0


def test_the_predicted_tbt_counts_the_requests_still_decoding_at_the_first_token():
    # d1 runs "short" (10 output tokens, about 0.6 s of steps) and "long" (200, some 12 s)
    # from placements made before. A new 100-token request's first token is predicted
    # 1.1 s out (p1 idle): "short" has finished by then, "long" has not. Its predicted
    # TBT is the step at batch 2 (long + itself), not 3 (the batch of the moment).
    svc = service(ttft_slo=100.0)
    svc.settings.conductor.tbt_slo_s = math.inf
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    assert place(svc, "short", n=16, decode_only=True)["ok"]
    assert place(svc, "long", n=16, max_new_tokens=200, decode_only=True)["ok"]
    running = {"rids": ["short", "long"], "batch": 2, "context_tokens": 40,
               "free_kv_tokens": 10_000}
    report(svc, "d1", "decode", decode=running)
    assert set(svc.nodes["d1"].decoding) == {"short", "long"}
    r = place(svc, "new")
    assert r["ok"] and abs(r["predicted_tbt_s"] - COST.decode_step_s(2, 20 + 100)) < 1e-9, r
    # a request decoding now with no placement on record (unknown end) still counts
    report(svc, "d1", "decode", decode={**running, "rids": ["short", "long", "x"], "batch": 3,
                                        "context_tokens": 60})
    # ("new", placed before, decodes from 1.1 s to about 1.8 s; "new2" from 2.2 s, after
    # "new"'s prefill and its own: they do not overlap)
    r = place(svc, "new2")
    assert abs(r["predicted_tbt_s"] - COST.decode_step_s(3, 60 - 20 + 100)) < 1e-9, r
    # reported finished: forgotten
    report(svc, "d1", "decode")
    assert not svc.nodes["d1"].decoding


def test_a_request_placed_again_does_not_count_its_own_earlier_placement():
    # d1 has KV room for one request of 110 tokens and a bit more, not for two. "r" is
    # placed, its hand-over fails, and it is placed again (decode only, or from scratch)
    # while its first placement is still in flight: that is the same request, not a
    # second one, so d1 still has room (it was a 429 decode_full, issue 34). Another
    # request is refused while "r" is in flight.
    svc = service(ttft_slo=100.0)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode", decode={"rids": [], "batch": 0, "context_tokens": 0,
                                        "free_kv_tokens": 150})
    assert place(svc, "r")["ok"] and "r" in svc.nodes["d1"].inflight_decode
    again = place(svc, "r", decode_only=True)
    assert again["ok"] and again["decode"]["node"] == "d1", again
    assert place(svc, "r")["ok"]
    other = place(svc, "s")
    assert not other["ok"] and other["reason"] == "decode_full", other


def test_spf_nodes_predict_the_wait_from_the_requests_their_reports_list_as_waiting():
    # p1 runs a (1,000 tokens: 10.1 s) with b (10.1 s) waiting; p2 runs c (20.1 s) alone.
    # A 100-token request (1.1 s) under FCFS predicts 20.2 + 1.1 s on p1 and 20.1 + 1.1 s
    # on p2; with spf queues it overtakes b: 10.1 + 1.1 s on p1.
    for policy, node, ttft in (("cost_aware", "p1", 11.2), ("global_cache_aware", "p2", 21.2)):
        svc = service(ttft_slo=100.0)
        svc.settings.conductor.policy = policy
        report(svc, "p1", "prefill", pending={"a": [1000, 0], "b": [1000, 0]}, waiting=["b"])
        report(svc, "p2", "prefill", pending={"c": [2000, 0]})
        report(svc, "d1", "decode")
        r = place(svc, "x")
        assert r["ok"] and r["prefill"]["node"] == node, (policy, r)
        assert abs(r["predicted_ttft_s"] - ttft) < 0.01, (policy, r)


def test_queued_work_counts_waiting_and_unreported_placements():
    from mooncaked.conductor.load import NodeView, InflightPrefill, queued_work
    v = NodeView("p1")
    v.inflight_prefill = {"x": InflightPrefill(100, 0, 1.0), "y": InflightPrefill(200, 0, 2.0)}
    # idle node: the oldest unreported placement runs at once, the other waits
    assert queued_work(v, COST) == [2.1]
    v.prefill_pending, v.prefill_waiting = {"a": (1000, 0), "b": (300, 0)}, {"b"}
    # a runs, b waits; x and y arrive behind it
    assert queued_work(v, COST) == [3.1, 1.1, 2.1]


def test_excluded_draining_and_silent_nodes_get_nothing():
    svc = service(ttft_slo=100.0)
    for n in ("p1", "p2"):
        report(svc, n, "prefill")
    report(svc, "d1", "decode")
    report(svc, "d2", "decode", draining=True)
    assert place(svc, "x", exclude=["p1"])["prefill"]["node"] == "p2"
    for i in range(5):
        assert place(svc, f"y{i}")["decode"]["node"] == "d1"
    svc.nodes["p2"].reported_at = time.monotonic() - svc.stale_s - 1     # p2 went silent
    svc._started_mono -= svc.stale_s                                     # past the warm-up
    r = place(svc, "z", exclude=["p1"])
    assert not r["ok"] and r["reason"] == "no_prefill_node"
    r = place(svc, "w", exclude=["d1"], decode_only=True)
    assert not r["ok"] and r["reason"] == "no_decode_node"


def test_decode_only_replacement_picks_another_decode_node():
    svc = service()
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    report(svc, "d2", "decode")
    r = place(svc, "q", exclude=["d1"], decode_only=True)
    assert r["ok"] and r["decode"]["node"] == "d2" and r["fetch"] is None
    assert svc.nodes["p1"].inflight_prefill == {}        # the prefill side was not charged


def test_index_from_reported_events_steers_prefix_hits():
    from mooncaked.store.types import Inventory

    svc = service(ttft_slo=100.0)
    keys = [bytes([i]) * 16 for i in range(8)]
    for n in ("p1", "p2"):
        report(svc, n, "prefill")
        svc.index.load_inventory(Inventory(n, 0, {}))   # what start() pulls: empty stores
        svc.nodes[n].store_seq = 0
    report(svc, "d1", "decode")
    report(svc, "p2", "prefill", store_seq=1,
           events=[{"kind": "stored", "tier": "dram", "seq": 1, "keys": [k.hex() for k in keys]}])
    assert svc.index.blocks_on("p2") == 8
    r = place(svc, "hit", n=8 * 16 + 5, keys=keys)
    assert r["prefill"]["node"] == "p2" and r["prefix_tokens"] == 128
    # a gap in p2's sequence numbers is noticed (its inventory is pulled again)
    svc.nodes["p2"].info["store"] = {"segment": {}}
    report(svc, "p2", "prefill", store_seq=5, events=[
        {"kind": "evicted", "tier": "dram", "seq": 5, "keys": [keys[0].hex()]}])
    assert "p2" in svc._pulls
    assert svc.index.blocks_on("p2") == 8                 # nothing applied past the gap
    svc._pulls["p2"].cancel()


def test_a_prefill_refit_never_makes_cached_tokens_cost_less_than_nothing():
    """Solo prefills whose cached-prefix ones ran faster than their new tokens alone would
    say (here: 0.1 s + 1 ms a new token, minus 0.25 ms a cached one, as a fresh user's
    cluster learned) fit a negative cost per cached token, which predicts a long prefix
    hit at 0 s. Such a fit is refused, as for decode: the model keeps a cost that grows
    with the cached tokens."""
    svc = service()
    report(svc, "p1", "prefill")
    before = svc.cost.prefill_s(14, 416)
    done = [{"rid": f"c{i}", "seconds": 0.1 + 0.001 * n - 0.00025 * c, "new": n, "cached": c,
             "alone": True}
            for i, (n, c) in enumerate([(16, 0), (64, 0), (256, 0), (512, 0),
                                        (16, 128), (32, 256), (64, 128), (128, 256)] * 2)]
    report(svc, "p1", "prefill", done=done)
    assert svc.refits == 0
    assert min(svc.cost.prefill.coef) >= 0
    assert svc.cost.prefill_s(14, 416) >= 0.5 * before > 0


def test_prefill_model_is_refit_from_solo_requests():
    svc = service()
    report(svc, "p1", "prefill")
    done = [{"rid": f"s{i}", "seconds": 0.5 + 0.02 * n, "new": n, "cached": 0, "alone": True}
            for i, n in enumerate([16, 32, 64, 128, 256, 512] * 3)]
    report(svc, "p1", "prefill", done=done)
    assert svc.refits == 1
    # exact samples of a law inside the model's terms: the fit recovers it (measured error
    # about 1e-15 s)
    assert abs(svc.cost.prefill_s(300, 0) - (0.5 + 0.02 * 300)) < 1e-9
    assert svc.status()["cost_model"]["meta"]["refit"]["mean_rel_error"] < 1e-9
    assert svc.status()["cost_model"]["meta"]["refit"]["samples"] == 16


def test_decode_model_is_refit_from_reported_steps():
    svc = service()
    report(svc, "d1", "decode")
    truth = lambda b, c: 0.03 + 0.002 * b + 1e-5 * c          # noqa: E731 - this machine's law
    before = svc.cost.decode_step_s(8, 4000)
    steps = [[b, c, truth(b, c)] for b in (1, 2, 4, 8, 16, 32) for c in (500, 2000, 8000)] * 4
    report(svc, "d1", "decode", decode_steps=steps[:CALIBRATE_EVERY])
    st = svc.status()
    assert st["decode_step_prediction"]["samples"] == CALIBRATE_EVERY
    # the loaded model (COST) is off: its median |predicted - measured| / measured
    first = steps[:CALIBRATE_EVERY]
    off = statistics.median(abs(COST.decode_step_s(b, c) - t) / t for b, c, t in first)
    assert abs(st["decode_step_prediction"]["median_abs_rel_error"] - off) < 1e-9
    assert off > 0.5
    # ... so those 8 steps calibrated it: scaled by their median measured / predicted ratio
    r = statistics.median(t / COST.decode_step_s(b, c) for b, c, t in first)
    assert abs(svc.status()["cost_model"]["scale"]["decode"] - r) < 1e-12
    assert abs(svc.cost.decode_step_s(8, 4000) - r * before) < 1e-12
    report(svc, "d1", "decode", decode_steps=steps[CALIBRATE_EVERY:40])
    assert svc.decode_refits == 0                                      # 64 steps before a try
    report(svc, "d1", "decode", decode_steps=steps[40:])
    assert svc.decode_refits == 1
    assert abs(before - truth(8, 4000)) > 0.04                        # 0.13 s before the refit
    assert abs(svc.cost.decode_step_s(8, 4000) - truth(8, 4000)) < 1e-9    # exact after it
    meta = svc.status()["cost_model"]["meta"]["decode_refit"]
    assert meta["samples"] == 64 and meta["mean_rel_error"] < 1e-9


def test_hot_prefix_is_replicated_onto_a_cache_node_once():
    svc = service(ttft_slo=100.0)
    keys = [bytes([i]) * 16 for i in range(6)]
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    report(svc, "c1", "cache")
    for n in ("p1", "c1"):
        svc.nodes[n].control = f"127.0.0.1:{n}"
    svc.nodes["c1"].info["store"] = {"segment": {}}
    svc.index.stored("p1", keys[:4])                       # p1 holds the first 4 blocks
    place(svc, "a", n=6 * 16 + 3, keys=keys)
    assert svc.replicated["started"] == 0                 # requested once: not hot yet
    r = place(svc, "b", n=6 * 16 + 3, keys=keys)
    assert r["ok"] and svc.replicated["started"] == 1     # hot: c1 copies p1's 4 blocks
    place(svc, "b2", n=6 * 16 + 3, keys=keys)
    assert svc.replicated["started"] == 1                 # not again while it is copied
    assert svc.status()["replication"]["hot_block_hits"] == 2
    svc.index.stored("c1", keys[:4])                       # the copy landed: 2 replicas
    place(svc, "c", n=6 * 16 + 3, keys=keys)
    assert svc.replicated["started"] == 1
    # c1 now holds the prefix too: it is a fetch source for a prefill node without it
    report(svc, "p2", "prefill")
    report(svc, "p1", "prefill", pending={"busy": [5000, 0]})
    r = place(svc, "d", n=6 * 16 + 3, keys=keys)
    assert r["prefill"]["node"] == "p2" and r["fetch"]["source"] == "c1"
    assert r["prefix_tokens"] == 64


def test_decode_refit_never_accepts_a_negative_coefficient():
    svc = service()
    report(svc, "d1", "decode")
    # steps that get faster with context (noise on a shared machine, say): a least-squares
    # fit has a negative context term and would predict <= 0 for long contexts
    steps = [[b, c, 0.2 + 0.002 * b - 2e-5 * c] for b in (1, 2, 4, 8) for c in (500, 2000, 8000)]
    report(svc, "d1", "decode", decode_steps=steps * 6)
    assert svc.decode_refits == 0
    # only calibrated: COST's decode model scaled (same terms, proportional coefficients)
    k = svc.status()["cost_model"]["scale"]["decode"]
    assert svc.cost.decode.terms == COST.decode.terms and k > 0
    assert all(abs(c - k * c0) < 1e-12 for c, c0 in zip(svc.cost.decode.coef, COST.decode.coef))


def test_a_request_over_the_slo_even_when_idle_is_unattainable_not_overloaded():
    # 0.1 s + 10 ms a token against a 3 s SLO: at most 290 tokens meet it on an idle node.
    svc = service(ttft_slo=3.0)
    report(svc, "p1", "prefill")
    report(svc, "d1", "decode")
    rej = place(svc, "long", n=3000)
    assert not rej["ok"] and rej["reason"] == "ttft_slo_unattainable", rej
    assert rej["max_prompt_tokens"] == 290 and abs(rej["predicted_ttft_s"] - 30.1) < 1e-9
    assert place(svc, "fits", n=290)["ok"]             # the named length is admitted
    # Under load (the 290 tokens queued: 3.0 s) a prompt that fits when idle stays a
    # 429-style ttft_slo rejection.
    busy = place(svc, "c", n=250)
    assert not busy["ok"] and busy["reason"] == "ttft_slo" and busy["max_prompt_tokens"] is None
    assert svc.status()["rejected"] == {"ttft_slo_unattainable": 1, "ttft_slo": 1}


def test_not_ready_until_a_prefill_and_a_decode_node_have_reported():
    """What API nodes' /health follows: a request sent now would be placed."""
    svc = service()
    assert "prefill or a decode" in svc.not_ready()
    report(svc, "p1", "prefill")
    assert svc.not_ready().endswith("no report from a decode node yet")
    report(svc, "d1", "decode")
    assert svc.not_ready() is None and place(svc, "a")["ok"]
    coupled = service()
    report(coupled, "a1", "all")
    assert coupled.not_ready() is not None          # a coupled node needs its control address


def test_a_fetch_is_predicted_at_its_paths_measured_rate_not_the_median(capsys):
    # c1 (a cache node) holds a 6-block prefix; p1 is 50 s busy, p2 idle and without it.
    # Recomputing 99 tokens costs 0.1 + 0.99 s; fetching 96 of them costs 96 kB / rate.
    svc = service(ttft_slo=100.0)
    svc.settings.conductor.hot_block_hits = 0            # no replication in the way
    keys = [bytes([i]) * 16 for i in range(6)]
    report(svc, "d1", "decode")
    report(svc, "c1", "cache")
    svc.nodes["c1"].control = "127.0.0.1:c1"
    svc.nodes["c1"].info["store"] = {"segment": {}}
    svc.index.stored("c1", keys)
    report(svc, "p1", "prefill", pending={"busy": [5000, 0]}, links={"c1": 1e9})
    # p2's engine measured c1 -> p2 at 10 kB/s (9.6 s for the prefix): p2 recomputes,
    # though the median of the measured paths (p1's 1 GB/s and p2's 10 kB/s) is fast
    report(svc, "p2", "prefill", links={"c1": 1e4})
    r = place(svc, "slow", n=6 * 16 + 3, keys=keys)
    assert r["prefill"]["node"] == "p2" and r.get("fetch") is None, r
    assert r["prefix_tokens"] == 0
    st = svc.status()["transfer_bandwidth"]
    assert st["fetch_paths"] == {"c1->p1": 1_000_000_000, "c1->p2": 10_000}
    assert st["used_bytes_per_s"] == statistics.median([1e9, 1e4]) and st["measured_paths"] == 2
    from mooncaked.cli.ctl import _print_conductor     # what `mooncake ctl status` says
    _print_conductor(svc.status())
    out = capsys.readouterr().out
    assert ("transfer bandwidth in the cost model: 4.00 Gbit/s (median of 2 measured paths; "
            "configured 8.00 Gbit/s); fetches over a measured path at its rate: "
            "c1->p1 8.00 Gbit/s, c1->p2 80 kbit/s") in out, out
    # the same path measured fast: p2 fetches from c1
    report(svc, "p2", "prefill", links={"c1": 1e9})
    r = place(svc, "fast", n=6 * 16 + 3, keys=keys)
    assert r["prefill"]["node"] == "p2" and r["fetch"]["source"] == "c1", r
    assert r["prefix_tokens"] == 96
    # a fixed cost model (refit off) keeps its configured rate: the slow measurement is
    # not used, so p2 fetches (placement reproducible whatever the load measured)
    report(svc, "p2", "prefill", links={"c1": 1e4})
    svc.settings.conductor.refit_cost_model = False
    r = place(svc, "fixed", n=6 * 16 + 3, keys=keys)
    assert r["prefill"]["node"] == "p2" and r["fetch"]["source"] == "c1", r
    st = svc.status()["transfer_bandwidth"]
    assert st["measured_paths"] == 0 and st["fetch_paths"] == {}
