"""Request-level sampling semantics through the OpenAI API, as vLLM serves them:
`stop_token_ids`, `include_stop_str_in_output` (stop tokens and stop strings) and `echo`
on /v1/completions.

vLLM's rules checked here (vllm/v1/core/sched/utils.py check_stop, vllm/v1/engine/
detokenizer.py BaseIncrementalDetokenizer.update and the v0 StopChecker): a stop token
ends the request with finish_reason "stop" and stop_reason = the token id; the token
counts as a completion token and keeps its logprobs, but its text is not part of the
output unless include_stop_str_in_output. A stop string is cut from the output (and
generation stops) unless include_stop_str_in_output, which keeps it. echo prepends the
prompt text to the choice's text (stream: to the first chunk).

One real `mooncaked serve --role all` (SmolLM2-135M on CPU) for the module; greedy
outputs so they can be compared exactly.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cluster_harness import apost as post, stream

PROMPT = "The capital of France is"
N_FREE = 12
GREEDY = {"temperature": 0, "ignore_eos": True}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server(default_server):
    """The run's default server (conftest): shared, so tests leave it as they found it."""
    return default_server


@pytest.fixture(scope="module")
def free(server) -> dict:
    """PROMPT's greedy continuation of N_FREE tokens: text, per-token texts (from logprobs)
    and token ids (re-tokenized and checked token by token against the texts)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{server.url}/v1/completions",
                                      {"prompt": PROMPT, "max_tokens": N_FREE, "logprobs": 0, **GREEDY})
            assert status == 200, body
            text = body["choices"][0]["text"]
            toks = body["choices"][0]["logprobs"]["tokens"]
            _, enc = await post(s, f"{server.url}/tokenize", {"prompt": text})
            _, penc = await post(s, f"{server.url}/tokenize", {"prompt": PROMPT})
            singles = [(await post(s, f"{server.url}/detokenize", {"tokens": [t]}))[1]["prompt"]
                       for t in enc["tokens"]]
        return {"text": text, "tokens": toks, "ids": enc["tokens"], "singles": singles,
                "prompt_ids": penc["tokens"]}
    out = run(go())
    assert len(out["tokens"]) == N_FREE and "".join(out["tokens"]) == out["text"]
    # the re-tokenized ids are the generated ones: same count, same text per token
    assert out["singles"] == out["tokens"], (out["singles"], out["tokens"])
    assert len(out["ids"]) == N_FREE
    return out


def stop_token_case(free: dict) -> int:
    """Index k of a generated token that first occurs at k >= 2 and has visible text."""
    ids, toks = free["ids"], free["tokens"]
    for k in range(2, len(ids) - 1):
        if ids[k] not in ids[:k] and toks[k].strip():
            return k
    raise AssertionError(f"no usable stop token in {toks}")


# ---------------------------------------------------------------------------- stop_token_ids


def test_stop_token_ids_stop_with_the_token_counted_but_not_in_the_text(server, free):
    k = stop_token_case(free)
    stop_id, toks = free["ids"][k], free["tokens"]

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            req = {"prompt": PROMPT, "max_tokens": N_FREE, "stop_token_ids": [stop_id], **GREEDY}
            _, plain = await post(s, url, req)
            _, with_lp = await post(s, url, {**req, "logprobs": 1})
            events = await stream(s, url, {**req, "stream": True})
        return plain, with_lp, events

    plain, with_lp, events = run(go())
    ch = plain["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id
    assert plain["usage"]["completion_tokens"] == k + 1           # the stop token counts
    assert ch["text"] == "".join(toks[:k])                         # ... its text does not
    assert not ch["text"].endswith(toks[k])
    # logprobs still cover every generated token, the stop token included (as vLLM)
    lp = with_lp["choices"][0]["logprobs"]
    assert lp["tokens"] == toks[:k + 1] and len(lp["token_logprobs"]) == k + 1
    assert with_lp["choices"][0]["text"] == ch["text"]
    # streaming sends the same text and ends with the same reason
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ch["text"]
    last = events[-2]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop_id


def test_stop_token_text_is_kept_with_include_stop_str_in_output(server, free):
    k = stop_token_case(free)
    stop_id, toks = free["ids"][k], free["tokens"]

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            req = {"prompt": PROMPT, "max_tokens": N_FREE, "stop_token_ids": [stop_id],
                   "include_stop_str_in_output": True, **GREEDY}
            _, body = await post(s, url, req)
            events = await stream(s, url, {**req, "stream": True})
        return body, events

    body, events = run(go())
    ch = body["choices"][0]
    assert ch["text"] == "".join(toks[:k + 1])
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == k + 1
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ch["text"]


def test_a_stop_token_never_generated_changes_nothing(server, free):
    unused = next(t for t in range(1000, 2000) if t not in free["ids"])

    async def go():
        async with aiohttp.ClientSession() as s:
            return await post(s, f"{server.url}/v1/completions",
                              {"prompt": PROMPT, "max_tokens": N_FREE, "stop_token_ids": [unused],
                               **GREEDY})
    _, body = run(go())
    assert body["choices"][0]["text"] == free["text"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["stop_reason"] is None


# ---------------------------------------------------------------------------- stop strings


def stop_string_case(free: dict) -> tuple[str, int]:
    """A stop string made of two whole generated tokens after the first two, and where it
    first occurs in the output text."""
    toks, text = free["tokens"], free["text"]
    for k in range(2, len(toks) - 2):
        stop = (toks[k] + toks[k + 1]).strip()
        if len(stop) >= 3:
            return stop, text.index(stop)
    raise AssertionError(f"no usable stop string in {toks}")


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_for_stop_strings(server, free, include):
    stop, at = stop_string_case(free)
    full = free["text"]
    want = full[:at + len(stop)] if include else full[:at]

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            req = {"prompt": PROMPT, "max_tokens": N_FREE, "stop": [stop],
                   "include_stop_str_in_output": include, **GREEDY}
            _, body = await post(s, url, req)
            events = await stream(s, url, {**req, "stream": True})
        return body, events

    body, events = run(go())
    ch = body["choices"][0]
    assert ch["text"] == want
    assert (stop in ch["text"]) is include
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert body["usage"]["completion_tokens"] < N_FREE        # generation really stopped
    streamed = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(streamed) == want
    if not include:
        assert all(stop not in t for t in streamed)


# ---------------------------------------------------------------------------- echo


def test_echo_prepends_the_prompt_text(server, free):
    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            req = {"max_tokens": N_FREE, "echo": True, **GREEDY}
            _, text_prompt = await post(s, url, {**req, "prompt": PROMPT})
            _, id_prompt = await post(s, url, {**req, "prompt": free["prompt_ids"]})
            events = await stream(s, url, {**req, "prompt": PROMPT, "stream": True})
            _, batch = await post(s, url, {**req, "prompt": [PROMPT, "2 + 2 ="], "n": 2,
                                           "max_tokens": 3})
            _, other = await post(s, url, {"prompt": "2 + 2 =", "max_tokens": 3, **GREEDY})
            _, detok = await post(s, f"{server.url}/detokenize", {"tokens": free["prompt_ids"]})
        return text_prompt, id_prompt, events, batch, other, detok

    text_prompt, id_prompt, events, batch, other, detok = run(go())
    ch = text_prompt["choices"][0]
    assert ch["text"] == PROMPT + free["text"]
    assert text_prompt["usage"]["completion_tokens"] == N_FREE      # echo adds no tokens
    # a token-id prompt echoes its decoded text
    assert id_prompt["choices"][0]["text"] == detok["prompt"] + free["text"]
    # streaming: the prompt comes with the first chunk, then the same deltas
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0]["text"] for e in events[:-1]]
    assert chunks[0].startswith(PROMPT)
    assert "".join(chunks) == PROMPT + free["text"]
    # each choice of a batch with n = 2 echoes its own prompt
    three = "".join(free["tokens"][:3])
    want = [PROMPT + three] * 2 + ["2 + 2 =" + other["choices"][0]["text"]] * 2
    assert [c["text"] for c in batch["choices"]] == want


def test_echo_with_stop_keeps_the_prompt_and_cuts_the_output(server, free):
    stop, at = stop_string_case(free)

    async def go():
        async with aiohttp.ClientSession() as s:
            return await post(s, f"{server.url}/v1/completions",
                              {"prompt": PROMPT, "max_tokens": N_FREE, "echo": True, "stop": stop,
                               **GREEDY})
    _, body = run(go())
    assert body["choices"][0]["text"] == PROMPT + free["text"][:at]


