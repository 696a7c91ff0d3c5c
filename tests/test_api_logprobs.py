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
import orjson
import pytest
from cluster_harness import CONSTRAINED_LOGPROBS, logprob_values, stream
from cluster_harness import apost as post

from mooncaked.api.logprobs import TextOffset
from mooncaked.benchmarks import hf_reference

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


@pytest.mark.parametrize("case", sorted(CONSTRAINED_LOGPROBS))
def test_constrained_output_logprobs_are_numbers(server, case):
    """Issue 32, fault 1: a grammar masks alternatives (logprob -inf); like vLLM's OpenAI
    server the response carries -9999.0 for them, never null, streamed or not."""
    url = f"{server.url}/v1/{'chat/completions' if case.startswith('chat') else 'completions'}"
    body = CONSTRAINED_LOGPROBS[case]

    async def go():
        async with aiohttp.ClientSession() as s:
            # each its own cache_salt: both compute the prompt cold (see above)
            return (await post(s, url, {**body, "cache_salt": f"{case}-1"})), \
                await stream(s, url, {**body, "stream": True, "cache_salt": f"{case}-2"})
    (status, out), events = asyncio.run(go())
    assert status == 200, out
    vals = logprob_values(out)
    assert any(v > -9999.0 for v in vals), vals
    if case.endswith("choice"):
        assert -9999.0 in vals, vals              # a masked alternative, shown as a number
    chunks = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]]
    streamed = [v for c in chunks for v in logprob_values({"choices": c["choices"]})]
    assert streamed == vals


def test_echo_and_prompt_logprobs_score_the_prompt(server):
    """Prompt logprobs on one process (issue 32): echo with logprobs and max_tokens 0
    (what lm-evaluation-harness's local-completions sends for a loglikelihood) answers the
    prompt's tokens, the first with a null logprob as OpenAI does; the scores are those of
    generation (the logprob of ' Paris' after the question equals what a 1-token greedy
    completion of the question reports); vLLM's prompt_logprobs ranks each token; a
    cached prefix is recomputed (no prefix hit, the same values); streamed the same."""
    url = f"{server.url}/v1/completions"
    text = "The capital of France is Paris"
    echo = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0,
            "cache_salt": "echo-lp"}
    scored = {"prompt": text, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
              "cache_salt": "echo-lp"}

    async def go():
        async with aiohttp.ClientSession() as s:
            out = [await post(s, url, b) for b in (
                echo, scored, scored,
                {"prompt": text.removesuffix(" Paris"), "max_tokens": 1, "temperature": 0,
                 "logprobs": 0, "cache_salt": "echo-lp"},
                {"prompt": text, "prompt_logprobs": -1},
                {"prompt": text, "max_tokens": 0})]
            events = await stream(s, url, {**echo, "stream": True})
            chat = await post(s, f"{server.url}/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "prompt_logprobs": 0})
            return out, events, chat
    out, events, (chat_status, chat) = asyncio.run(go())
    (s1, e), (s2, p), (s3, again), (s4, gen), (s5, bad), (s6, zero) = out
    assert (s1, s2, s3, s4) == (200, 200, 200, 200), out
    c = e["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == text and c["finish_reason"] == "length"
    assert e["usage"]["completion_tokens"] == 0 and e["usage"]["prompt_tokens"] == len(lp["tokens"]) == 6
    assert "".join(lp["tokens"]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [text.index(t, o) for t, o in zip(lp["tokens"], lp["text_offset"])]
    assert lp["text_offset"][0] == 0 and all(v < 0 for v in lp["token_logprobs"][1:])
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == v and 2 <= len(top) <= 3
    # the score of ' Paris' is the logprob generation gives it after the question
    g = gen["choices"][0]["logprobs"]
    assert g["tokens"] == [" Paris"]
    assert abs(g["token_logprobs"][0] - lp["token_logprobs"][-1]) < 1e-4
    # vLLM's prompt_logprobs: None first, then {token id: {logprob, rank, decoded_token}}
    pl = p["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == 6
    for entry, tok, v in zip(pl[1:], lp["tokens"][1:], lp["token_logprobs"][1:]):
        mine = [x for x in entry.values() if x["decoded_token"] == tok]
        assert mine and mine[0]["logprob"] == v and mine[0]["rank"] >= 1
        # the top 3 ranked 1..3, and the prompt token beside them when it is not among them
        in_top = mine[0]["rank"] <= 3
        ranks = sorted(x["rank"] for x in entry.values() if in_top or x is not mine[0])
        assert ranks == [1, 2, 3] and len(entry) == (3 if in_top else 4)
        best = max(x["logprob"] for x in entry.values())
        assert (mine[0]["rank"] == 1) == (mine[0]["logprob"] == best)
    assert p["choices"][0]["text"] and p["usage"]["completion_tokens"] == 2
    # the repeat finds the prompt cached, recomputes it and answers the same values
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["prompt_logprobs"] == pl
    assert s5 == 400 and bad["error"]["param"] == "prompt_logprobs"
    assert s6 == 400 and zero["error"]["param"] == "max_tokens"
    chunks = [x for x in events if x != "[DONE]"]
    assert "".join(x["choices"][0]["text"] for x in chunks) == text
    assert [x["choices"][0]["logprobs"] for x in chunks if x["choices"][0]["logprobs"]] == [lp]
    assert chat_status == 200 and chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# lm-evaluation-harness on the served model and on transformers, the same weights (fp32):
# each item's loglikelihood (a sum over the answer's tokens) differs by float rounding only,
# 4.1e-5 at most measured here (AMD EPYC, torch 2.13, transformers 5.24), bound 1e-3; so
# the accuracies are equal unless two answers of an item are within twice that. Where
# `dtype = auto` runs the prompt projections in bf16 (AVX512-BF16, model/numerics.py: prompt
# logits within 1.0 of fp32), the bound is LM_EVAL_LL_ATOL_BF16 (0.139 measured on AMD EPYC
# Zen 4) and each item's pick must agree where transformers' best two answers are further
# apart than twice it. Where it runs them with int8 activations (AVX2 / AVX-512 VNNI,
# kernels/cpu_gemm.py: prompt logits within 2.0 of fp32) the bound is LM_EVAL_LL_ATOL_INT8
# (0.79 measured on AMD EPYC Zen 4 compiled for AVX2 only).
LM_EVAL_LL_ATOL = 1e-3
LM_EVAL_LL_ATOL_BF16 = 0.5
LM_EVAL_LL_ATOL_INT8 = 1.5


def test_lm_eval_harness_scores_the_server_as_transformers(server, bundled_model, tmp_path):
    """The real lm-evaluation-harness (issue 32): its `local-completions` model against the
    server (echo + logprobs: prompt logprobs) and its `hf` model on the same GGUF weights,
    on a multiple-choice task of 32 items from local files (tests/lm_eval_tasks, no hub),
    offline. Same accuracy, and every item's every answer scored the same within
    LM_EVAL_LL_ATOL (lm-eval's log_samples)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mooncaked.model.tokenizer import Tokenizer

    root = Path(__file__).parent.parent
    tok = tmp_path / "tokenizer"     # lm-eval loads it by path: no hub, no second conversion
    Tokenizer(bundled_model, []).hf.save_pretrained(tok)   # the GGUF's, as transformers converts it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    api = (f"base_url={server.url}/v1/completions,model=SmolLM2-135M-Instruct.Q4_1,"
           f"tokenizer={tok},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    # transformers' reading of the GGUF file, as a checkpoint in the load cache (hf_reference.py)
    hf = f"pretrained={hf_reference.checkpoint_dir(bundled_model)},tokenizer={tok},dtype=float32"
    r = subprocess.run([sys.executable, str(root / "tests/lm_eval_tasks/run_mc_facts.py"),
                        "local-completions", api, "hf", hf], cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ours, theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(ours["items"]) == len(theirs["items"]) == 32
    numerics = next(orjson.loads(ln) for ln in server.log.read_text().splitlines()
                    if '"numerics"' in ln)
    exact = numerics["prompt_matmul"] == "float32"
    bound = {"float32": LM_EVAL_LL_ATOL, "bfloat16": LM_EVAL_LL_ATOL_BF16,
             "int8": LM_EVAL_LL_ATOL_INT8}[numerics["prompt_matmul"]]
    worst = 0.0
    for a, b in zip(ours["items"], theirs["items"]):
        assert a["doc_id"] == b["doc_id"] and len(a["loglikelihoods"]) == 4
        worst = max(worst, *(abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"])))
        top2 = sorted(b["loglikelihoods"])[-2:]
        if top2[1] - top2[0] > 2 * bound:   # a clear pick: the same answer wins
            assert a["loglikelihoods"].index(max(a["loglikelihoods"])) == \
                b["loglikelihoods"].index(max(b["loglikelihoods"])), (a, b)
    assert worst < bound, (worst, numerics["prompt_matmul"])
    if exact:
        assert ours["acc"] == theirs["acc"] and ours["acc_norm"] == theirs["acc_norm"]
    assert 0.5 <= ours["acc"] < 1.0          # the model knows some and misses some
