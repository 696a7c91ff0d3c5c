"""Logprobs keep each token's identity (issue 18, fault 4).

A byte-level vocabulary splits an emoji into tokens that are not valid UTF-8
alone. Each logprob entry's `bytes` are that token's real bytes (they
concatenate to the UTF-8 of the content), and distinct token ids get distinct
token strings (`bytes:\\xNN` for a partial character, as OpenAI writes it;
`token_id:N` with vLLM's `return_tokens_as_token_ids`). Checked for chat and
completions, streamed and not, on a real server.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from cluster_harness import apost as post, stream

from mooncaked.api.logprobs import TextOffset

CHAT = {"messages": [{"role": "user", "content": "Reply with only emoji: 🫠🫠🫠"}],
        "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
COMPLETION = {"prompt": "🫠🫠🫠🫠🫠🫠🫠🫠", "max_tokens": 6, "temperature": 0, "logprobs": 3}


@pytest.fixture(scope="module")
def server(default_server):
    """The run's default server (conftest): shared, so tests leave it as they found it."""
    return default_server


def token_bytes(token: str) -> bytes:
    """The bytes a logprob token string names (text, or OpenAI's bytes:\\xNN form)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token[6:]))
    return token.encode("utf-8")


def check_chat(content: str, entries: list[dict]) -> None:
    assert content and len(entries) == 3
    assert b"".join(bytes(e["bytes"]) for e in entries) == content.encode("utf-8")
    for e in entries:
        assert "\ufffd" not in e["token"]
        assert token_bytes(e["token"]) == bytes(e["bytes"])
        tops = e["top_logprobs"]
        assert len(tops) == 2 and len({t["token"] for t in tops}) == 2
        assert all(token_bytes(t["token"]) == bytes(t["bytes"]) for t in tops)
    # The emoji is split: some token is not valid UTF-8 alone and says so.
    assert any(e["token"].startswith("bytes:") for e in entries)


def test_chat_logprob_bytes_are_the_tokens_bytes(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            # Each its own cache_salt: both compute the prompt cold, so their logprobs are
            # equal bit for bit (on a prefix hit the last prompt tokens run as a smaller
            # step, whose fp32 GEMM may round differently on some CPUs: seen here, 2e-7).
            status, body = await post(s, f"{server.url}/v1/chat/completions", {**CHAT, "cache_salt": "a"})
            events = await stream(s, f"{server.url}/v1/chat/completions",
                                  {**CHAT, "stream": True, "cache_salt": "b"})
        return status, body, events
    status, body, events = asyncio.run(go())
    assert status == 200, body
    choice = body["choices"][0]
    check_chat(choice["message"]["content"], choice["logprobs"]["content"])
    chunks = [e for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    entries = [x for c in chunks if c["choices"][0]["logprobs"]
               for x in c["choices"][0]["logprobs"]["content"]]
    assert text == choice["message"]["content"]
    assert entries == choice["logprobs"]["content"]


def test_completion_logprob_tokens_name_their_bytes(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{server.url}/v1/completions", COMPLETION)
            events = await stream(s, f"{server.url}/v1/completions",
                                  {**COMPLETION, "stream": True})
            _, ids = await post(s, f"{server.url}/v1/completions",
                                {**COMPLETION, "return_tokens_as_token_ids": True})
        return status, body, events, ids
    status, body, events, ids = asyncio.run(go())
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert b"".join(token_bytes(t) for t in lp["tokens"]) == choice["text"].encode("utf-8")
    assert all("\ufffd" not in t for t in lp["tokens"])
    assert any(t.startswith("bytes:") for t in lp["tokens"])  # a split character was generated
    for top in lp["top_logprobs"]:
        assert len(top) >= 3          # distinct ids never collapse into one key
    # text_offset counts characters of the text, a split character once.
    off = TextOffset()
    expect = []
    for t in lp["tokens"]:
        expect.append(off.chars)
        off.advance(token_bytes(t))
    assert lp["text_offset"] == expect and off.chars == len(choice["text"])
    chunks = [e for e in events if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed = [t for c in chunks if c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [t for c in chunks if c["choices"][0]["logprobs"]
               for t in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["tokens"] and offsets == lp["text_offset"]
    # vLLM's return_tokens_as_token_ids: every token is token_id:N, distinct per id.
    id_tokens = ids["choices"][0]["logprobs"]["tokens"]
    assert len(id_tokens) == len(lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", t) for t in id_tokens)
    assert ids["choices"][0]["text"] == choice["text"]
