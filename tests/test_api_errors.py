"""Bad input to the OpenAI API gets the right status and an OpenAI error body, and the
server keeps answering good requests correctly; SIGTERM shuts it down gracefully.

One real `mooncaked serve --role all` (SmolLM2-135M on CPU) for the module's error tests,
and one more for the SIGTERM test, which stops it (tests run in any order).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import aiohttp
import orjson
import pytest

from cluster_harness import apost as post, run_server, stream

GOOD = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
LONG_BODY_BYTES = 5 * 1024 * 1024   # above the server's 4 MiB client_max_size


@pytest.fixture(scope="module")
def server(default_server):
    """The run's default server (conftest): shared, so tests leave it as they found it."""
    return default_server


@pytest.fixture(scope="module")
def info(server):
    """The served model card and the reference answer to GOOD."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{server.url}/v1/models") as r:
                card = (await r.json())["data"][0]
            status, body = await post(s, f"{server.url}/v1/completions", GOOD)
            assert status == 200, body
            return card, body["choices"][0]["text"]
    card, text = asyncio.run(go())
    assert text
    return {"model": card["id"], "max_model_len": card["max_model_len"], "good_text": text}


def chat(**kw):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def comp(**kw):
    return {"prompt": "Hello", "max_tokens": 2, **kw}


# (id, path, body (dict, bytes, or a function of the model info), status, param, code)
CASES = [
    ("malformed_json", "/v1/completions", b'{"prompt": "x",', 400, None, "invalid_json"),
    ("not_an_object", "/v1/chat/completions", b'[1, 2]', 400, None, "invalid_json"),
    ("prompt_wrong_type", "/v1/completions", comp(prompt=12), 400, "prompt", "invalid_type"),
    ("prompt_missing", "/v1/completions", {"max_tokens": 2}, 400, "prompt", "missing_required"),
    ("prompt_empty_list", "/v1/completions", comp(prompt=[]), 400, "prompt",
     "invalid_value"),
    ("prompt_empty_string", "/v1/completions", comp(prompt=""), 400, "prompt", "invalid_value"),
    ("max_tokens_string", "/v1/completions", comp(max_tokens="5"), 400, "max_tokens",
     "invalid_type"),
    ("temperature_string", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature",
     "invalid_type"),
    ("stream_not_bool", "/v1/completions", comp(stream="yes"), 400, "stream", "invalid_type"),
    ("stop_wrong_type", "/v1/completions", comp(stop=[1, 2]), 400, "stop", "invalid_type"),
    ("messages_wrong_type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages",
     "invalid_type"),
    ("unknown_model_completions", "/v1/completions", comp(model="gpt-17"), 404, "model",
     "model_not_found"),
    ("unknown_model_chat", "/v1/chat/completions", chat(model="gpt-17"), 404, "model",
     "model_not_found"),
    ("prompt_longer_than_context", "/v1/completions",
     lambda i: comp(prompt=[42] * (i["max_model_len"] + 1)), 400, "prompt",
     "context_length_exceeded"),
    ("prompt_plus_max_tokens_too_long", "/v1/completions",
     lambda i: comp(prompt=[42] * 10, max_tokens=i["max_model_len"]), 400, "max_tokens",
     "context_length_exceeded"),
    ("max_tokens_zero", "/v1/completions", comp(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens_negative", "/v1/chat/completions", chat(max_tokens=-3), 400, "max_tokens", None),
    ("max_completion_tokens_zero", "/v1/chat/completions", chat(max_completion_tokens=0), 400,
     "max_completion_tokens", None),
    ("temperature_high", "/v1/completions", comp(temperature=2.5), 400, "temperature", None),
    ("top_p_zero", "/v1/completions", comp(top_p=0), 400, "top_p", None),
    ("top_p_high", "/v1/chat/completions", chat(top_p=1.5), 400, "top_p", None),
    ("top_k_negative", "/v1/completions", comp(top_k=-2), 400, "top_k", None),
    ("min_p_high", "/v1/completions", comp(min_p=1.5), 400, "min_p", None),
    ("repetition_penalty_zero", "/v1/completions", comp(repetition_penalty=0), 400,
     "repetition_penalty", None),
    ("presence_penalty_high", "/v1/chat/completions", chat(presence_penalty=2.5), 400,
     "presence_penalty", None),
    ("frequency_penalty_low", "/v1/completions", comp(frequency_penalty=-2.5), 400,
     "frequency_penalty", None),
    ("logprobs_too_many", "/v1/completions", comp(logprobs=1000), 400, "logprobs", None),
    ("top_logprobs_too_many", "/v1/chat/completions", chat(logprobs=True, top_logprobs=1000), 400,
     "top_logprobs", None),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400,
     "top_logprobs", None),
    ("n_zero", "/v1/completions", comp(n=0), 400, "n", None),
    ("token_id_out_of_vocab", "/v1/completions", comp(prompt=[1, 10**9]), 400, "prompt[1]",
     "invalid_value"),
    # wider than 64 bits: the JSON parser gives a float; still an id out of the vocabulary
    ("token_id_wider_than_64_bits", "/v1/completions",
     b'{"prompt": [1, 123456789012345678901234567890], "max_tokens": 2}', 400, "prompt[1]",
     "invalid_value"),
    # the element that is wrong is named, not the list (a fresh user saw "got list")
    ("prompt_float_token_id", "/v1/completions", comp(prompt=[1.5, 2]), 400, "prompt[0]",
     "invalid_type"),
    ("prompt_bool_token_id", "/v1/completions", comp(prompt=[2, True]), 400, "prompt[1]",
     "invalid_type"),
    ("prompt_mixed_kinds", "/v1/completions", comp(prompt=[1, "a"]), 400, "prompt",
     "invalid_type"),
    ("prompt_batch_float_token_id", "/v1/completions", comp(prompt=[[1], [2.5]]), 400,
     "prompt[1][0]", "invalid_type"),
    ("token_id_wider_than_64_bits_in_a_batch", "/v1/completions",
     b'{"prompt": [[1], [123456789012345678901234567890]], "max_tokens": 2}', 400,
     "prompt[1][0]", "invalid_value"),
    ("stop_token_id_out_of_vocab", "/v1/completions", comp(stop_token_ids=[-1]), 400,
     "stop_token_ids[0]", "invalid_value"),
    ("stop_token_id_wrong_type", "/v1/completions", comp(stop_token_ids=[2, "x"]), 400,
     "stop_token_ids[1]", "invalid_type"),
    ("stream_options_without_stream", "/v1/completions",
     comp(stream_options={"include_usage": True}), 400, "stream_options", None),
    ("prompt_logprobs_whole_vocab", "/v1/completions", comp(prompt_logprobs=-1), 400,
     "prompt_logprobs", None),
    ("max_tokens_zero_without_echo", "/v1/completions", comp(max_tokens=0), 400, "max_tokens",
     None),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("missing_messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages",
     "missing_required"),
    ("bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("image_part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0]", "unsupported"),
    ("empty_cache_salt", "/v1/completions", comp(cache_salt=""), 400, "cache_salt", None),
]


async def _good_request_still_works(s: aiohttp.ClientSession, server, info) -> None:
    status, body = await post(s, f"{server.url}/v1/completions", GOOD)
    assert status == 200, body
    assert body["choices"][0]["text"] == info["good_text"]


def _check_error(body: dict, status: int, param, code) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param
    assert err["code"] == code


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_body(server, info, case):
    _, path, body, status, param, code = case
    if callable(body):
        body = body(info)

    async def go():
        async with aiohttp.ClientSession() as s:
            got, err = await post(s, f"{server.url}{path}", body)
            assert got == status, err
            _check_error(err, status, param, code)
            await _good_request_still_works(s, server, info)
    asyncio.run(go())


def test_a_wrong_prompt_element_is_named_in_the_message(server, info):
    """The message names the element's type and place, not "got list" (a fresh user's
    finding), and a token id wider than 64 bits is out of the vocabulary, not a float."""
    want = {"[1.5, 2]": "'prompt[0]' must be a token id (an integer), a string, or a list "
                        "of token ids, got float",
            "[2, true]": "'prompt[1]' must be a token id (an integer), a string, or a list "
                         "of token ids, got bool",
            '[1, "a"]': "it mixes them",
            "[[1], [2.5]]": "'prompt[1][0]' must be a token id (an integer), got float",
            "[[1], [2, 99999999]]": "'prompt[1][1]': token id 99999999 is outside the "
                                    "vocabulary",
            "[123456789012345678901234567890]": "'prompt[0]': token id wider than 64 bits "
                                                "is outside the vocabulary",
            '""': "'prompt' must not be empty",
            "[]": "'prompt' must not be empty",
            "[[1], []]": "'prompt[1]' must not be empty",
            '["hi", ""]': "'prompt[1]' must not be empty"}

    async def go():
        async with aiohttp.ClientSession() as s:
            for prompt, text in want.items():
                got, err = await post(s, f"{server.url}/v1/completions",
                                      f'{{"prompt": {prompt}, "max_tokens": 2}}'.encode())
                assert got == 400 and text in err["error"]["message"], (prompt, err)
    asyncio.run(go())


def test_unknown_route_wrong_method_and_too_large(server, info):
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{server.url}/v1/nothing-here", {"a": 1})
            assert status == 404
            _check_error(body, 404, None, "not_found")

            async with s.get(f"{server.url}/v1/completions") as r:
                assert r.status == 405
                assert "POST" in r.headers["Allow"]
                _check_error(await r.json(), 405, None, "method_not_allowed")
            async with s.delete(f"{server.url}/v1/models") as r:
                assert r.status == 405
                _check_error(await r.json(), 405, None, "method_not_allowed")

            big = orjson.dumps({"prompt": "x" * LONG_BODY_BYTES, "max_tokens": 1})
            status, body = await post(s, f"{server.url}/v1/completions", big)
            assert status == 413
            _check_error(body, 413, None, "request_too_large")

            async with s.get(f"{server.url}/v1/models/not-a-model") as r:
                assert r.status == 404
                _check_error(await r.json(), 404, "model", "model_not_found")
            await _good_request_still_works(s, server, info)
    asyncio.run(go())


def test_streaming_request_with_bad_input_gets_status_not_stream(server, info):
    """A bad streamed request is refused with a 4xx before any SSE is sent."""
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{server.url}/v1/chat/completions",
                                      chat(stream=True, max_tokens=0))
            assert status == 400
            _check_error(body, 400, "max_tokens", None)
            events = await stream(s, f"{server.url}/v1/completions", {**GOOD, "stream": True})
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == info["good_text"]
    asyncio.run(go())


def _log_event(log, event: str, timeout_s: float) -> dict:
    """The first JSON line of the server's log whose "event" is `event`, waiting for it at
    most timeout_s (polling the file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in log.read_bytes().splitlines():
            if line.startswith(b"{") and f'"event":"{event}"'.encode() in line:
                return orjson.loads(line)
        assert time.monotonic() < deadline, f"no {event} in the server log within {timeout_s} s"
        time.sleep(0.02)   # poll interval


def _refused_at(port: int, timeout_s: float) -> float:
    """Opens new TCP connections to 127.0.0.1:port until one is refused; returns when
    (time.time()). A connection the kernel accepted in the instant before the listener
    closed is dropped and tried again, within timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            return time.time()
        assert time.monotonic() < deadline, f"new connections still accepted after {timeout_s} s"
        time.sleep(0.02)   # poll interval


def test_sigterm_finishes_in_flight_stream_refuses_new_connections_and_exits_zero(tmp_path):
    """Graceful shutdown: a stream in flight when SIGTERM arrives still ends with [DONE];
    once the server logged shutting_down, a new connection is refused while it still runs
    (before it logs stopped, server-side time); the process exits 0."""
    with run_server(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1])

        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
                        "ignore_eos": True}
                status, whole = await post(s, f"{server.url}/v1/completions", body)
                assert status == 200, whole
                body["stream"] = True
                async with s.post(f"{server.url}/v1/completions", data=orjson.dumps(body)) as r:
                    assert r.status == 200
                    first = await asyncio.wait_for(r.content.readline(), 60)
                    assert first.startswith(b"data: {")
                    server.proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(_log_event, server.log, "shutting_down", 30)
                    refused = await asyncio.to_thread(_refused_at, port, 10)
                    rest = await asyncio.wait_for(r.content.read(), 60)
            return first + rest, refused, whole["choices"][0]["text"]

        text, refused, whole_text = asyncio.run(go())
        lines = [ln for ln in text.decode().split("\n") if ln]
        assert lines[-1] == "data: [DONE]"
        chunks = [orjson.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # all of it: the same 32 greedy tokens' text as the same request unstreamed
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole_text
        assert server.proc.wait(timeout=60) == 0
        stopped = _log_event(server.log, "stopped", 0)
        assert refused < stopped["ts"], (refused, stopped)
