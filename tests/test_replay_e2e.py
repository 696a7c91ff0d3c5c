"""End to end: `mooncake bench trace` against a real `mooncaked serve --role all` on loopback.

Replays the first requests of the shared conversation trace, scaled down so CPU prefill
stays short, one at a time (--concurrency-limit 1) so each request finds the blocks of
the ones before it: all of them start with hash id 0, so every request after the first
must report exactly that block as cached prompt tokens. The chat test writes its own trace
and needs nothing shared.
"""

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from mooncaked.model.tokenizer import Tokenizer
from mooncaked.replay import load_trace
from mooncaked.replay.prompts import scale_length

BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 300.0
BLOCK = 16               # the engine's block size; also 512 trace tokens at --length-scale 32


@pytest.fixture(scope="module")
def server(default_server):
    """The URL of the run's default `mooncaked serve --role all` (conftest; shared)."""
    return default_server.url


def bench(args, cwd):
    cp = subprocess.run([str(BIN / "mooncake"), "bench", "trace", *args, "--json",
                         "--no-progress"], capture_output=True, text=True, cwd=cwd,
                        timeout=RUN_TIMEOUT_S)
    assert cp.returncode == 0, cp.stderr[-3000:]
    return orjson.loads(cp.stdout.strip().splitlines()[-1])


def expected_cached_tokens(trace_path: Path, limit: int, length_scale: int) -> list[int]:
    """Cached prompt tokens each of the first `limit` requests must report when replayed one
    at a time in order on a fresh server: the full blocks whose hash-id prefix an earlier
    request already sent (a hash id is one BLOCK-token block at this scale), never the
    block holding the last prompt token (the engine computes at least one token)."""
    assert 512 // length_scale == BLOCK
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in load_trace(trace_path, limit=limit):
        n = scale_length(r.input_length, length_scale)
        ids = r.hash_ids[: n // BLOCK]          # the hash ids whose block is wholly sent
        hit = 0
        while hit < len(ids) and ids[: hit + 1] in seen:
            hit += 1
        out.append(BLOCK * min(hit, (n - 1) // BLOCK))
        seen.update(ids[: j + 1] for j in range(len(ids)))
    return out


def test_replay_conversation_prefix_hits(server, tmp_path, shared_trace):
    out = tmp_path / "out"
    summary = bench([str(shared_trace), "--url", server, "--limit", "6", "--length-scale", "32",
                     "--time-scale", "0", "--concurrency-limit", "1", "--max-output-tokens", "4",
                     "--timeout", "120", "--out", str(out)], tmp_path)
    doc = orjson.loads((out / "replay.json").read_bytes())
    recs = doc["requests"]
    assert summary == doc["summary"]
    assert summary["requests"] == 6 and summary["completed"] == 6
    assert summary["rejected"] == 0 and summary["errors"] == 0
    trace = load_trace(shared_trace, limit=6)
    assert [r["index"] for r in recs] == [r.index for r in trace]
    for r, t in zip(recs, trace):
        assert r["ok"], r["error"]
        assert r["ttft_s"] > 0
        assert r["output_tokens"] == r["max_tokens"] == min(4, scale_length(t.output_length, 32))
        assert len(r["token_times_s"]) == r["output_tokens"]  # ignore_eos
        # token-id prompts: the server counts exactly what was sent (no BOS added)
        assert r["prompt_tokens"] == r["sent_prompt_tokens"] == scale_length(t.input_length, 32)
    # All six start with hash id 0 = one 16-token block at --length-scale 32 (one engine
    # block at block_size 16) and share nothing after it; run in order, so request 0 is
    # cold and each later one hits exactly that block.
    cached = [r["cached_tokens"] for r in recs]
    assert cached == expected_cached_tokens(shared_trace, 6, 32) == [0] + [BLOCK] * 5
    assert summary["cached_tokens"] == sum(cached)
    assert summary["cache_hit_rate"] == pytest.approx(sum(cached) / summary["prompt_tokens"])
    assert (out / "ttft_cdf.png").exists() and (out / "tbt_cdf.png").exists()


def test_replay_text_input_over_chat(server, tmp_path, bundled_model):
    trace = tmp_path / "text.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 8, "output_length": 3, "hash_ids": [], '
        '"text_input": "Name a colour."}\n'
        '{"timestamp": 50, "input_length": 8, "output_length": 2, "hash_ids": [], '
        '"text_input": "Name a fruit."}\n')
    summary = bench([str(trace), "--url", server, "--text-api", "chat", "--timeout", "120",
                     "--out", str(tmp_path / "out")], tmp_path)
    assert summary["completed"] == 2 and summary["errors"] == 0
    assert summary["output_tokens"] == 5
    # Sent through the chat template: the server counts the templated prompt's tokens.
    tok = Tokenizer(bundled_model, [])
    assert summary["prompt_tokens"] == sum(
        len(tok.apply_chat_template([{"role": "user", "content": q}]))
        for q in ("Name a colour.", "Name a fruit."))
    assert summary["ttft_mean_s"] > 0
