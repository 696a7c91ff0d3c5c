"""The OpenAI API over the real engine: response and chunk shapes, /v1/models, /health,
/metrics, prefix caching through the API, concurrency, stop strings, client disconnects.

One real `mooncaked serve --role all` (SmolLM2-135M on CPU) for the module. Outputs
are greedy (temperature 0) so they can be compared exactly; max_tokens stays small.
The tests run in any order and each one alone: a test that depends on the prefix cache
uses a fresh cache_salt, and counters are compared before and after.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import orjson
import pytest

from cluster_harness import apost as post, metrics, stream

PROMPT = "The capital of France is"
# 45 tokens: two full 16-token blocks a repeat can find cached.
LONG_PROMPT = ("A library keeps books on shelves sorted by author. Every morning the librarian "
               "walks the rows, returns the books people left on the tables, and writes down "
               "which shelves need dusting. Today she found a note inside a novel:")
DISCONNECT_WAIT_S = 30.0
BLOCK = 16                      # engine.block_size


@pytest.fixture(scope="module")
def server(default_server):
    """The run's default server (conftest): shared, so tests leave it as they found it."""
    return default_server


@pytest.fixture(scope="module")
def model(server) -> str:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/v1/models") as r:
            return (await r.json())["data"][0]["id"]
    return asyncio.run(go())


def run(coro):
    return asyncio.run(coro)


def salt() -> str:
    """A fresh cache_salt: this request shares no cached blocks with any other test's."""
    return uuid.uuid4().hex


def reusable(prompt_tokens: int) -> int:
    """Prompt tokens a repeat of a prompt finds cached: every full block but the one holding
    the last prompt token (engine/block_manager.py match_prefix: its logits are needed)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


# ---------------------------------------------------------------------------- small routes


def test_models_and_health(server, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{server.url}/health") as r:
                assert r.status == 200 and (await r.json()) == {"status": "ok"}
            async with s.get(f"{server.url}/v1/models") as r:
                body = await r.json()
            assert body["object"] == "list" and len(body["data"]) == 1
            card = body["data"][0]
            assert card["id"] == model and card["object"] == "model"
            assert card["id"].startswith("SmolLM2-135M")
            assert card["max_model_len"] > 512
            async with s.get(f"{server.url}/v1/models/{model}") as r:
                assert r.status == 200 and (await r.json())["id"] == model
    run(go())


# ---------------------------------------------------------------------------- completions


def test_completion_non_streaming_shape(server, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, f"{server.url}/v1/completions",
                                      {"model": model, "prompt": PROMPT, "max_tokens": 5,
                                       "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["model"] == model and isinstance(body["created"], int)
            (choice,) = body["choices"]
            assert choice["index"] == 0 and choice["finish_reason"] == "length"
            assert choice["text"].startswith(" Paris"), choice["text"]
            u = body["usage"]
            assert u["completion_tokens"] == 5
            assert u["total_tokens"] == u["prompt_tokens"] + 5
            # shorter than a block: nothing of it can ever be cached, whatever ran before
            assert u["prompt_tokens"] <= BLOCK
            assert u["prompt_tokens_details"]["cached_tokens"] == reusable(u["prompt_tokens"]) == 0
    run(go())


def test_completion_streaming_matches_non_streaming(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            req = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            _, full = await post(s, f"{server.url}/v1/completions", req)
            events = await stream(s, f"{server.url}/v1/completions",
                                  {**req, "stream": True, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        *chunks, usage_chunk = events[:-1]
        assert {c["id"] for c in chunks} == {usage_chunk["id"]}
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 6
        assert usage_chunk["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    run(go())


def test_token_id_prompt_and_batches(server):
    """A prompt as token ids, as a list of one string, and a batch of two prompts with n=2
    give the same greedy text as the plain string prompt."""
    async def go():
        async with aiohttp.ClientSession() as s:
            req = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
            _, plain = await post(s, f"{server.url}/v1/completions", {**req, "prompt": PROMPT})
            _, tok = await post(s, f"{server.url}/tokenize", {"prompt": PROMPT})
            assert tok["count"] == len(tok["tokens"]) == plain["usage"]["prompt_tokens"]
            _, by_ids = await post(s, f"{server.url}/v1/completions",
                                   {**req, "prompt": tok["tokens"]})
            _, one = await post(s, f"{server.url}/v1/completions", {**req, "prompt": [PROMPT]})
            _, batch = await post(s, f"{server.url}/v1/completions",
                                  {**req, "prompt": [PROMPT, "2 + 2 ="], "n": 2})
            _, other = await post(s, f"{server.url}/v1/completions", {**req, "prompt": "2 + 2 ="})
        text = plain["choices"][0]["text"]
        assert by_ids["choices"][0]["text"] == text
        assert by_ids["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        assert one["choices"][0]["text"] == text
        assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in batch["choices"]] == [text, text, other["choices"][0]["text"],
                                                          other["choices"][0]["text"]]
        assert batch["usage"]["prompt_tokens"] == (plain["usage"]["prompt_tokens"]
                                                   + other["usage"]["prompt_tokens"])
        assert batch["usage"]["completion_tokens"] == 16
    run(go())


def test_completion_logprobs_and_seed(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            _, g = await post(s, f"{server.url}/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                               "ignore_eos": True, "logprobs": 3})
            sampled = {"prompt": "My favourite animal is the", "max_tokens": 8,
                       "temperature": 1.0, "seed": 1234, "ignore_eos": True}
            _, a = await post(s, f"{server.url}/v1/completions", sampled)
            _, b = await post(s, f"{server.url}/v1/completions", sampled)
        lp = g["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
        assert "".join(lp["tokens"]) == g["choices"][0]["text"]
        assert lp["text_offset"][0] == 0
        assert lp["text_offset"][1] == len(lp["tokens"][0])
        for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert val <= 0 and len(top) >= 3
            assert top[tok] == pytest.approx(max(top.values()))   # greedy picks the argmax
        assert a["choices"][0]["text"] == b["choices"][0]["text"]   # same seed, same output
    run(go())


# ---------------------------------------------------------------------------- chat


def test_chat_non_streaming_and_streaming(server, model):
    # A question whose first answer token is clear (fp32 top-2 gap 2.5 nats): France's is a
    # 0.08-nat tie between "The" and "L" even in fp32, which the int8 prompt projections of
    # auto on AVX2 (model/numerics.py) resolve the other way.
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]

    async def go():
        async with aiohttp.ClientSession() as s:
            req = {"model": model, "messages": msgs, "max_completion_tokens": 12,
                   "temperature": 0}
            status, full = await post(s, f"{server.url}/v1/chat/completions", req)
            assert status == 200, full
            parts = [{"role": "user", "content": [
                {"type": "text", "text": "What is the capital of Japan?"}]}]
            _, by_parts = await post(s, f"{server.url}/v1/chat/completions",
                                     {**req, "messages": parts})
            events = await stream(s, f"{server.url}/v1/chat/completions", {**req, "stream": True})
            _, lp = await post(s, f"{server.url}/v1/chat/completions",
                               {**req, "logprobs": True, "top_logprobs": 2, "max_tokens": 3})
        assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
        (choice,) = full["choices"]
        assert choice["message"]["role"] == "assistant"
        assert "Tokyo" in choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length")
        if choice["finish_reason"] == "length":
            assert full["usage"]["completion_tokens"] == 12
        else:
            assert full["usage"]["completion_tokens"] <= 12
        assert by_parts["choices"][0]["message"] == choice["message"]

        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == choice["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]

        content = lp["choices"][0]["logprobs"]["content"]
        assert len(content) == lp["usage"]["completion_tokens"]
        # one entry per generated token, the EOS that ended it included (as vLLM does)
        assert "".join(e["token"] for e in content).startswith(lp["choices"][0]["message"]["content"])
        for e in content:
            assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0
            assert bytes(e["bytes"]).decode() == e["token"]
    run(go())


# ---------------------------------------------------------------------------- engine features


def test_same_prompt_twice_hits_the_prefix_cache(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            req = {"prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0, "cache_salt": salt()}
            _, first = await post(s, f"{server.url}/v1/completions", req)
            _, second = await post(s, f"{server.url}/v1/completions", req)
            _, other_salt = await post(s, f"{server.url}/v1/completions",
                                       {**req, "cache_salt": salt()})
        n = first["usage"]["prompt_tokens"]
        assert n > 2 * BLOCK                            # at least two full 16-token blocks
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens"] == n
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == reusable(n)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        # a different cache_salt never shares blocks
        assert other_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other_salt["choices"][0]["text"] == first["choices"][0]["text"]
    run(go())


def test_16_concurrent_streams_match_each_alone(server):
    """Requests of different prompt and output lengths, streamed all at once, give the same
    tokens as each one run alone (fresh cache salts: the concurrent round recomputes)."""
    base = "Count the apples in the basket, then tell me how many are red"
    reqs = [{"prompt": base + ", please" * i, "max_tokens": 3 + i % 6, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "stream": True} for i in range(16)]

    def tokens(events):
        assert events[-1] == "[DONE]"
        return [t for e in events[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            alone_salt, together_salt = salt(), salt()
            alone = [tokens(await stream(s, url, {**r, "cache_salt": alone_salt})) for r in reqs]
            together = await asyncio.gather(*(stream(s, url, {**r, "cache_salt": together_salt})
                                              for r in reqs))
        assert [len(t) for t in alone] == [r["max_tokens"] for r in reqs]
        assert [tokens(ev) for ev in together] == alone
    run(go())


def _stop_case(tokens: list[str]) -> str:
    """A stop string spanning three generated tokens: the end of one, the whole next one,
    the start of the one after (tokens chosen so each contributes characters)."""
    for k in range(1, len(tokens) - 2):
        a, b, c = tokens[k], tokens[k + 1], tokens[k + 2]
        if len(a.strip()) >= 2 and b.strip() and len(c.strip()) >= 2:
            return a[-2:] + b + c[:2]
    raise AssertionError(f"no three-token stop string in {tokens}")


def test_stop_string_spanning_tokens(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/completions"
            req = {"prompt": LONG_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            _, free = await post(s, url, {**req, "logprobs": 0})
            toks = free["choices"][0]["logprobs"]["tokens"]
            stop = _stop_case(toks)
            full = free["choices"][0]["text"]
            expected = full[:full.index(stop)]
            _, stopped = await post(s, url, {**req, "stop": [stop, "never-appears-zzz"]})
            events = await stream(s, url, {**req, "stop": stop, "stream": True})
        ch = stopped["choices"][0]
        assert ch["text"] == expected and stop not in ch["text"]
        assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
        assert stopped["usage"]["completion_tokens"] < 24     # generation really stopped
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert "".join(texts) == expected
        assert all(stop not in t for t in texts)
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    run(go())


# ---------------------------------------------------------------------------- metrics, disconnect


NAMED_SERIES = [
    "mooncaked_time_to_first_token_seconds_bucket{le=+Inf}",
    "mooncaked_inter_token_latency_seconds_bucket{le=+Inf}",
    "mooncaked_request_tbt_seconds_count",
    "mooncaked_e2e_request_latency_seconds_count",
    "mooncaked_num_requests_running",
    "mooncaked_num_requests_waiting",
    "mooncaked_kv_blocks_used",
    "mooncaked_kv_blocks_capacity",
    "mooncaked_prefix_hit_tokens_total",
    "mooncaked_prompt_tokens_total",
    "mooncaked_engine_prompt_tokens_total",
    "mooncaked_generation_tokens_total",
    "mooncaked_requests_total{finish_reason=length}",
    "mooncaked_requests_total{finish_reason=stop}",
    "mooncaked_requests_total{finish_reason=abort}",
]


def test_metrics_series_change_after_a_request(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await metrics(s, server.url)
            _, body = await post(s, f"{server.url}/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                  "ignore_eos": True})
            after = await metrics(s, server.url)
        # a labelled counter's series appears with its first increment: on a fresh server
        # (this test first) `before` lacks the finish_reason and route series
        for name in NAMED_SERIES:
            assert name in after, name

        def delta(name):
            return after[name] - before.get(name, 0.0)
        assert delta("mooncaked_time_to_first_token_seconds_count") == 1
        assert delta("mooncaked_inter_token_latency_seconds_count") == 3
        assert delta("mooncaked_request_tbt_seconds_count") == 1
        assert delta("mooncaked_requests_total{finish_reason=length}") == 1
        assert delta("mooncaked_generation_tokens_total") == 4
        assert delta("mooncaked_prompt_tokens_total") == body["usage"]["prompt_tokens"]
        assert delta("mooncaked_engine_prompt_tokens_total") == body["usage"]["prompt_tokens"]
        # a prompt shorter than a block has nothing to reuse, whatever ran before
        assert body["usage"]["prompt_tokens"] <= BLOCK
        assert delta("mooncaked_prefix_hit_tokens_total") == 0
        assert delta("mooncaked_time_to_first_token_seconds_sum") > 0
        assert after["mooncaked_kv_blocks_capacity"] > 0
        assert after["mooncaked_num_requests_running"] == 0
        assert delta("mooncaked_http_requests_total{route=/v1/completions,status=200}") == 1
    run(go())


def test_prompt_tokens_count_once_per_prompt_at_the_api(server):
    """The API's prompt_tokens_total counts a request's prompt once (as usage does) while
    the engine's own series counts each choice it admitted: with n=2 they differ."""
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await metrics(s, server.url)
            _, body = await post(s, f"{server.url}/v1/completions",
                                 {"prompt": PROMPT, "max_tokens": 1, "n": 2, "seed": 1,
                                  "temperature": 1.0, "cache_salt": salt()})
            after = await metrics(s, server.url)
        n = body["usage"]["prompt_tokens"]
        assert n > 0 and len(body["choices"]) == 2
        assert after["mooncaked_prompt_tokens_total"] - before["mooncaked_prompt_tokens_total"] == n
        assert (after["mooncaked_engine_prompt_tokens_total"]
                - before["mooncaked_engine_prompt_tokens_total"]) == 2 * n
    run(go())


def test_client_disconnect_aborts_the_request(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await metrics(s, server.url)
            body = {"prompt": LONG_PROMPT, "max_tokens": 2000, "temperature": 0,
                    "ignore_eos": True, "stream": True, "cache_salt": salt()}
            r = await s.post(f"{server.url}/v1/completions", data=orjson.dumps(body))
            assert r.status == 200
            for _ in range(3):
                line = await asyncio.wait_for(r.content.readline(), 60)
                assert line.startswith(b"data: {") or line == b"\n"
            during = await metrics(s, server.url)
            assert during["mooncaked_num_requests_running"] == 1
            r.close()                                  # drop the connection mid-stream
            deadline = time.monotonic() + DISCONNECT_WAIT_S
            http = "mooncaked_http_requests_total{route=/v1/completions,status=499}"
            while True:
                now = await metrics(s, server.url)
                # the cancelled stream is counted in the HTTP series too (issue 32, fault 6)
                if now["mooncaked_num_requests_running"] == 0 and \
                        now.get(http, 0) - before.get(http, 0) == 1:
                    break
                assert time.monotonic() < deadline, "request still running after disconnect"
                await asyncio.sleep(0.1)               # poll interval, bounded by the deadline
            aborted = (now["mooncaked_requests_total{finish_reason=abort}"]
                       - before["mooncaked_requests_total{finish_reason=abort}"])
            assert aborted == 1
            assert now["mooncaked_kv_blocks_used"] == before["mooncaked_kv_blocks_used"] == 0
            # and the server still serves
            status, ok = await post(s, f"{server.url}/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            assert status == 200 and ok["choices"][0]["text"]
    run(go())


def test_async_llm_and_cluster_frontend_implement_engine_client():
    """Both things the API serves (AsyncLLM in one process, ClusterFrontend on a cluster
    node) have every member of the EngineClient protocol, with a compatible generate().
    No model: the members are looked up statically (no property runs)."""
    import inspect
    from types import SimpleNamespace

    from mooncaked.api.engine_client import ApiTokenizer, EngineClient, EngineInfo
    from mooncaked.cluster.frontend import ClusterFrontend
    from mooncaked.config import load_settings
    from mooncaked.engine.async_llm import AsyncLLM
    from mooncaked.engine.types import SamplingParams
    from mooncaked.model.tokenizer import Tokenizer

    def members(proto) -> set[str]:
        return {n for c in proto.__mro__ if c.__dict__.get("_is_protocol")
                for n in c.__dict__ if not n.startswith("_")}

    assert members(EngineClient) == {"tokenizer", "model_name", "max_model_len", "max_logprobs",
                                     "generate", "abort", "stats"}
    assert members(EngineInfo) < members(EngineClient)
    for name in members(ApiTokenizer) - {"vocab_size"}:   # an instance attribute there
        assert callable(inspect.getattr_static(Tokenizer, name)), name

    settings = load_settings(None, {})
    tok = SimpleNamespace(vocab_size=10)
    fake_engine = SimpleNamespace(tokenizer=tok, model_name="m", max_model_len=64,
                                  max_logprobs=5, offload_finished=False)
    fake_port = SimpleNamespace(settings=settings, tokenizer=tok)
    llm = AsyncLLM(fake_engine)
    try:
        for impl in (llm, ClusterFrontend(fake_port)):
            for name in members(EngineClient):
                inspect.getattr_static(impl, name)         # AttributeError if missing
            assert inspect.isasyncgenfunction(type(impl).generate)
            inspect.signature(impl.generate).bind([1, 2], SamplingParams(), "rid", cache_salt=None)
            inspect.signature(impl.abort).bind("rid")
            inspect.signature(impl.stats).bind()
    finally:
        llm._executor.shutdown()


def test_a_close_cancelled_while_it_waits_still_aborts_and_counts():
    """A client that goes away can cancel its handler a second time while `_Run.close`
    waits for the pumps (after the write's ConnectionResetError; CI at d7068f6 counted
    the 499 and no abort). The request is still aborted on the engine and counted once.
    In-process: the real engine behind the API's `_Run`, the cancel placed at that await."""
    from mooncaked.api.metrics import ApiMetrics
    from mooncaked.api.protocol import parse_completion
    from mooncaked.api.server import _Run
    from mooncaked.config import load_settings
    from mooncaked.engine.async_llm import AsyncLLM
    from mooncaked.engine.llm_engine import LLMEngine

    async def main() -> tuple[float, int]:
        llm = AsyncLLM(LLMEngine(load_settings(None, {})))
        await llm.start()
        try:
            metrics = ApiMetrics(llm.stats)
            req = parse_completion({"model": llm.model_name, "prompt": LONG_PROMPT,
                                    "max_tokens": 500, "ignore_eos": True, "temperature": 0,
                                    "stream": True}, llm)
            r = _Run(llm, req, "cmpl-close", time.monotonic(), metrics)
            outputs = r.outputs()
            await asyncio.wait_for(anext(outputs), 60)       # the request is decoding
            await outputs.aclose()
            closing = asyncio.create_task(r.close())
            await asyncio.sleep(0)           # close() now waits for its cancelled pumps
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            deadline = time.monotonic() + DISCONNECT_WAIT_S
            while llm.stats().num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)    # poll interval, bounded by the deadline
            return (metrics.requests.labels("abort")._value.get(), llm.stats().num_running)
        finally:
            await llm.stop()

    aborted, running = asyncio.run(main())
    assert (aborted, running) == (1.0, 0)
