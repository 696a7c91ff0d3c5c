"""wire/messages.py: every message survives its JSON form (through orjson, as on the
wire), and a malformed body is a MessageError (a ValueError: the control server's 400)
naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import orjson
import pytest

from mooncaked.wire.errors import RpcError
from mooncaked.wire.rpc import ControlClient, ControlServer
from mooncaked.wire.messages import (CppChunk, CppPrefill, CppRequestRef, CppReserve, DecodeFailure, DecodeLoad, DecodeRequest, FetchPlan, KVHandle,
                                     KVReservation, KVReserved, MessageError, NodeRef, NodeReport,
                                     OutputDelta, PlaceRejected, PlaceReply, PlaceRequest,
                                     PrefillDone, PrefillRequest, Release, StoreEventMsg,
                                     place_result_from_json)
from mooncaked.engine.types import RequestOutput, SamplingParams, StructuredSpec, TokenLogprob

KEYS = (b"\x01" * 16, b"\x02" * 16)
KV = KVHandle({"segment": "p1/stage/r1", "access_key": "ab"}, (30, 2, 2, 16, 3, 64),
              "float32", 20, pushed=True, push={"bytes": 10, "ok": True})
PARAMS = SamplingParams(max_tokens=7, temperature=0.0, stop=["\n"], logprobs=2, seed=3)


def wire(msg) -> dict:
    """The message's JSON form as the peer reads it."""
    return orjson.loads(orjson.dumps(msg.to_json()))


@pytest.mark.parametrize("msg", [
    NodeRef("p1", "127.0.0.1:1", "http://127.0.0.1:1"),
    FetchPlan("c1", "127.0.0.1:2", KEYS),
    PlaceRequest("r1", KEYS, 40, 8, ("p2",), True),
    KV,
    PrefillRequest("r1", (1, 2, 3), PARAMS, "tenant", FetchPlan("c1", "a:1", KEYS), 16, True,
                   "127.0.0.1:3", 12.5),
    PrefillRequest("r1", (1, 2, 3), PARAMS, stage=True, ttl_s=3.0, admit_at="127.0.0.1:3"),
    KVReservation("r1", "127.0.0.1:4", (30, 2, 2, 16, 3, 64), "float32", 30.0),
    KVReservation("r1", "127.0.0.1:4", (), "", 30.0, admit_tokens=40),    # admission only
    KVReserved({"segment": "d1/recv/r1"}),
    Release("r1", "127.0.0.1:4"),
    Release("r1"),
    DecodeRequest("r1", (1, 2, 3), 9, PARAMS, KV, "127.0.0.1:3", "tenant"),
    DecodeRequest("r1", (1, 2, 3), 9, dataclasses.replace(PARAMS, structured=StructuredSpec(
        "json", '{"type":"object"}')), KV, "127.0.0.1:3", None),   # the constraint crosses
    PrefillDone("r1", 0.25, 30, 16, True),
    PrefillDone("r2", 1.5, 600, 0, False, ((0.25, 0.5), (0.125, 0.75))),   # a CPP group's stages
    StoreEventMsg("stored", "dram", 4, KEYS),
    DecodeLoad(("r1", "r2"), 2, 300, 1000),
    CppPrefill("r1", (1, 2, 3), 64, False, {"descriptor": {"segment": "d1/recv/r1"}},
               {"params": {"max_tokens": 4}, "prompt": [1, 2, 3]}, KEYS,
               {"control": "127.0.0.1:5", "blocks": 2}),
    CppPrefill("r1", (1, 2, 3)),                                   # greedy, no KV target
    CppReserve("r1", 40, True, None, None, KEYS, None),
    CppChunk("r1", 32, 40, True),
    CppRequestRef("r1"),
])
def test_round_trip(msg):
    assert type(msg).from_json(wire(msg)) == msg


def test_output_delta_round_trip_keeps_logprobs_and_stop_reason():
    out = RequestOutput("r1", [5, 6], "hi", True, "stop", 6,
                        [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.25)]),
                         TokenLogprob(6, -0.125, [])], num_cached_tokens=16,
                         num_output_tokens=2)
    delta = OutputDelta.of(out)
    back = OutputDelta.from_json(wire(delta))
    assert back == delta
    got = back.to_output("r1")
    assert (got.new_token_ids, got.new_text, got.finish_reason, got.stop_reason) == \
        ([5, 6], "hi", "stop", 6)
    assert got.logprobs[0].top == [(5, -0.5), (7, -1.25)] and got.num_cached_tokens == 16


def test_prefill_done_stages_are_checked():
    assert "stages" not in PrefillDone("r1", 0.25, 30, 16, True).to_json()   # unchanged wire form
    for bad in ([[0.1, -1.0]], [["x"]], [0.5], [[0.1] * 2000]):
        with pytest.raises(MessageError, match="stages"):
            PrefillDone.from_json({"rid": "r", "seconds": 1.0, "stages": bad})


def test_node_report_round_trip():
    r = NodeReport("p1", "prefill", True, {"r1": (30, 16)}, ("r1",), DecodeLoad(),
                   7, (StoreEventMsg("evicted", "ssd", 7, KEYS),),
                   (PrefillDone("r0", 0.5, 10, 0, False),), ((2, 300, 0.05),), ("r1",))
    assert NodeReport.from_json(wire(r)) == r and r.waiting == ("r1",)


def test_place_results():
    reply = PlaceReply(NodeRef("p1", "a:1"), NodeRef("d1", "b:2"), FetchPlan("c1", "c:3", KEYS),
                       32, 16, 0.5, 0.05)
    assert place_result_from_json(wire(reply)) == reply
    rejected = PlaceRejected("ttft_slo", 2.5, 4.0, None)
    assert place_result_from_json(wire(rejected)) == rejected


def test_decode_failure_line():
    f = DecodeFailure("bad stop", 400, "stop")
    assert DecodeFailure.from_line(wire(f)) == f
    assert DecodeFailure.from_line({"ids": [1], "text": "a", "finished": False}) is None


@pytest.mark.parametrize("cls, body, field", [
    (PlaceRequest, {"rid": "r", "keys": ["zz"]}, "keys"),
    (PlaceRequest, {"rid": "r", "prompt_tokens": "40"}, "prompt_tokens"),
    (PrefillRequest, {"rid": "r", "prompt": [1, "x"], "params": {}}, "prompt"),
    (PrefillRequest, {"rid": "r", "prompt": [1], "params": {"temperature": 0, "nope": 1}},
     "params"),
    (KVReservation, {"rid": "r", "shape": [1, 2], "dtype": 5}, "dtype"),
    (DecodeRequest, {"rid": "r", "prompt": [1], "first_token": 2, "params": {}}, "kv"),
    (PrefillRequest, {"rid": "r", "prompt": [1], "params": {"structured": {"kind": "json",
                                                                        "nope": 1}}}, "params"),
    (PrefillRequest, {"rid": "r", "prompt": [1], "params": {"structured": "json"}}, "params"),
    (NodeReport, {"role": "prefill"}, "node"),
    (Release, {"owner": "x"}, "rid"),
    (Release, ["r1"], "JSON object"),
    (CppPrefill, {"request_id": "r", "token_ids": [1, "2"]}, "token_ids"),
    (CppPrefill, {"request_id": "r", "token_ids": [1], "keys": ["zz"]}, "keys"),
    (CppPrefill, {"request_id": "r", "token_ids": [1], "sampling": "greedy"}, "sampling"),
    (CppReserve, {"request_id": "r"}, "num_tokens"),
    (CppChunk, {"request_id": "r", "start": 0, "end": 8, "last": "yes"}, "last"),
    (CppRequestRef, {}, "request_id"),
])
def test_malformed_bodies_name_the_field(cls, body, field):
    with pytest.raises(MessageError, match=field):
        cls.from_json(body)


def test_a_control_server_answers_400_with_the_message_error():
    async def run() -> RpcError:
        server = ControlServer()

        async def release(payload):
            return Release.from_json(payload).to_json()

        server.add_handler("node.release", release)
        host, port = await server.start("127.0.0.1", 0)
        try:
            async with ControlClient(5.0) as c:
                assert await c.call(f"{host}:{port}", "node.release", {"rid": "r1"}) == \
                    {"rid": "r1", "owner": None}
                with pytest.raises(RpcError) as e:
                    await c.call(f"{host}:{port}", "node.release", {"owner": "x"})
                return e.value
        finally:
            await server.stop()

    err = asyncio.run(run())
    assert (err.status, err.remote_type) == (400, "MessageError")
    assert err.remote_message == "missing field 'rid'"


def test_an_overload_names_the_prediction_that_broke_its_slo():
    from mooncaked.cluster.frontend import Overloaded

    tbt = Overloaded("tbt_slo", 1.2, predicted_ttft_s=2.37, predicted_tbt_s=1.5)
    assert (tbt.status, tbt.headers["Retry-After"]) == (429, "2")
    assert str(tbt).endswith("(tbt_slo); predicted TBT 1.500 s")
    ttft = Overloaded("ttft_slo", 3.0, predicted_ttft_s=6.0, predicted_tbt_s=0.1)
    assert str(ttft).endswith("(ttft_slo); predicted TTFT 6.00 s")
    none = Overloaded("no_prefill_node", 1.0)
    assert none.status == 503 and "no_prefill_node" in str(none)


def test_non_finite_logprobs_cross_the_wire_as_defined_strings():
    """A grammar-masked alternative's logprob is -inf: it travels as "-Infinity" (never
    null) and comes back as -inf; a null or a word is a MessageError naming the field."""
    lp = TokenLogprob(5, -0.25, [(5, -0.25), (7, -math.inf)])
    d = wire(OutputDelta((5,), "a", (lp,)))
    assert d["logprobs"] == [[5, -0.25, [[5, -0.25], [7, "-Infinity"]]]]
    back = OutputDelta.from_json(d).logprobs[0]
    assert back.token_id == 5 and back.logprob == -0.25 and back.top == [(5, -0.25), (7, -math.inf)]
    for bad in (None, "-inf", [1]):
        d["logprobs"][0][2][1][1] = bad
        with pytest.raises(MessageError, match="field 'logprobs'"):
            OutputDelta.from_json(d)


def test_an_unattainable_rejection_names_the_longest_prompt_that_would_pass():
    from mooncaked.cluster.frontend import SloUnattainable

    rej = PlaceRejected("ttft_slo_unattainable", 1.0, 18.06, None, None, 412)
    assert place_result_from_json(wire(rej)) == rej
    e = SloUnattainable(3000, 0.3, 18.06, 412)
    assert (e.status, e.code, getattr(e, "headers", None)) == (400, "slo_unattainable", None)
    assert "412 tokens" in str(e) and "18.06 s" in str(e)


def test_a_decode_refusal_crosses_two_control_calls_with_its_detail():
    """DecodeRefused (the decode node's TBT check before the prefill) answers 429 with the
    refusal as the error's detail; RpcError.remote_detail carries it to the prefill node,
    which raises it again for the API node (cluster/prefill_worker.py)."""
    from mooncaked.wire.errors import DecodeRefused

    refusal = {"error": "decode node at its TBT budget", "reason": "tbt_slo",
               "predicted_tbt_s": 1.2, "tbt_slo_s": 1.0, "retry_after_s": 1.0}

    async def run():
        server = ControlServer()

        async def refuse(p):
            raise DecodeRefused(refusal["error"], refusal)

        server.add_handler("node.kv_reserve", refuse)
        host, port = await server.start("127.0.0.1", 0)
        try:
            async with ControlClient(timeout_s=10) as client:
                with pytest.raises(RpcError) as e:
                    await client.call(f"{host}:{port}", "node.kv_reserve", {})
                return e.value
        finally:
            await server.stop()

    err = asyncio.run(run())
    assert (err.status, err.remote_type, err.remote_detail) == (429, "DecodeRefused", refusal)
    assert err.remote_message == refusal["error"]


def test_a_full_decode_receive_buffer_is_a_429_naming_it():
    """Issue 32, fault 8: the decode node's ReceiveBuffersFull (its class name crosses the
    RPC) is answered as load on that resource, not as a missing prefill node."""
    from mooncaked.cluster.frontend import Overloaded
    from mooncaked.cluster.node_state import ReceiveBuffersFull

    assert issubclass(ReceiveBuffersFull, ValueError)     # the control RPC answers 400
    e = Overloaded("decode_receive_buffers_full", 1.0,
                   detail="decode node d1: receive buffers full (1 + 2 bytes > engine.kv_cache_bytes)")
    assert (e.status, e.code, e.headers["Retry-After"]) == (429, "overloaded", "1")
    assert "(decode_receive_buffers_full); decode node d1: receive buffers full" in str(e)


def test_prompt_logprobs_cross_the_wire_with_their_ranks():
    """The prefill node's prompt logprobs (issue 32) ride on the first OutputDelta: null
    for the first prompt token, each other with its rank; a bad rank names the field."""
    lps = (None, TokenLogprob(9, -1.5, [(3, -0.5)], 2), TokenLogprob(4, -math.inf, [], 7))
    d = wire(OutputDelta((5,), "a", None, prompt_logprobs=lps))
    assert d["prompt_logprobs"] == [None, [9, -1.5, [[3, -0.5]], 2], [4, "-Infinity", [], 7]]
    back = OutputDelta.from_json(d)
    assert back.prompt_logprobs == lps and back.to_output("r").prompt_logprobs == list(lps)
    assert wire(OutputDelta((5,), "a"))["prompt_logprobs"] is None
    for bad in (-1, "2", True):
        d["prompt_logprobs"][1][3] = bad
        with pytest.raises(MessageError, match="field 'prompt_logprobs'"):
            OutputDelta.from_json(d)
