"""The engine under KV memory pressure with prefix caching on: a KV budget of 6 blocks
(96 tokens) for 4 requests that share a 32-token prefix and each grow by 20 greedy tokens.
Preemption (recompute), eviction of cached free blocks and prefix reuse all happen, the
block manager's invariants hold after every step, and every request's tokens equal the
same request run alone on a roomy engine.

Both engines share one load of the weights and tokenizer (read-only), so the module pays
for one model load.
"""

from __future__ import annotations

import pytest

from mooncaked.config import load_settings
from mooncaked.engine import llm_engine
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.types import SamplingParams

KV_BLOCKS = 6
MAX_STEPS = 2_000            # a bound on every step loop (the pressure run takes ~40)
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PREFIX = ("You are a helpful assistant for a small public library in the city. Answer every "
          "question in one short sentence, plainly and without lists, and never repeat the "
          "question back to the user.")
QUESTIONS = [" What is the capital of France?", " Name three colors.", " What is 2 + 2?",
             " Write one sentence about cats."]


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    """(roomy engine with the default KV budget, tight engine with KV_BLOCKS blocks)."""
    weights, tokenizers = {}, {}
    real_load, real_tok = llm_engine.load_weights, llm_engine.Tokenizer

    def load(path, **kw):
        key = (path, tuple(sorted(kw.items())))
        if key not in weights:
            weights[key] = real_load(path, **kw)
        return weights[key]

    def tok(path, eos):
        key = (path, tuple(eos))
        if key not in tokenizers:
            tokenizers[key] = real_tok(path, eos)
        return tokenizers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_weights", load)
        mp.setattr(llm_engine, "Tokenizer", tok)
        roomy = LLMEngine(load_settings(None, {}))
        tight = LLMEngine(load_settings(None, {"engine.kv_cache_bytes": roomy.block_bytes * KV_BLOCKS,
                                               "engine.enable_prefix_caching": True}))
    assert tight.block_manager.num_blocks == KV_BLOCKS
    return roomy, tight


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    tok = engines[0].tokenizer
    prefix = tok.encode(PREFIX)
    assert len(prefix) >= 32
    prefix = prefix[:32]                       # exactly two full 16-token blocks
    return [prefix + tok.encode(q) for q in QUESTIONS]


def check_invariants(engine: LLMEngine) -> None:
    """Pages are exactly one of free, cached free or used; a used page's refcount is the
    number of live sequences holding it (so no page with refcount > 0 is ever handed out
    or evicted); keys map both ways."""
    bm, sch = engine.block_manager, engine.scheduler
    holders = [0] * bm.num_blocks
    for seq in list(sch.running) + list(sch.waiting):
        for b in seq.block_table:
            holders[b] += 1
    for seq in sch.waiting:
        assert seq.block_table == []           # waiting requests hold no pages
    assert bm.ref_count == holders
    free, cached = set(bm.free), set(bm.cached_free.values())
    assert not free & cached and len(free) == len(bm.free)
    for b in range(bm.num_blocks):
        assert (b in free) + (b in cached) + (holders[b] > 0) == 1, b
    for key, b in bm.key_to_block.items():
        assert bm.block_key[b] == key
    assert bm.num_used_blocks == sum(1 for h in holders if h)


def run_alone(engine: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    engine.add_request(rid, prompt, PARAMS)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens += out.new_token_ids
    assert not engine.has_work(), "request did not finish within MAX_STEPS steps"
    return tokens


@pytest.fixture(scope="module")
def alone(engines, prompts) -> list[list[int]]:
    roomy = engines[0]
    return [run_alone(roomy, p, f"alone-{i}") for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def pressure(engines, prompts) -> dict:
    """Runs all prompts together on the tight engine; records outputs and what happened."""
    tight = engines[1]
    bm, sch = tight.block_manager, tight.scheduler
    for i, p in enumerate(prompts):
        tight.add_request(f"p{i}", p, PARAMS)
    res = {f"p{i}": {"tokens": [], "cached": 0, "reason": None} for i in range(len(prompts))}
    steps, max_used, max_waiting_with_running = 0, 0, 0
    for steps in range(1, MAX_STEPS + 1):
        if not tight.has_work():
            break
        for out in tight.step():
            r = res[out.request_id]
            r["tokens"] += out.new_token_ids
            r["cached"] = max(r["cached"], out.num_cached_tokens)
            r["reason"] = out.finish_reason
        check_invariants(tight)
        max_used = max(max_used, bm.num_used_blocks)
        if sch.running and sch.waiting:
            max_waiting_with_running = max(max_waiting_with_running, len(sch.waiting))
    assert not tight.has_work(), "the pressure run did not finish within MAX_STEPS steps"
    return {"res": [res[f"p{i}"] for i in range(len(prompts))], "steps": steps,
            "stats": tight.stats(), "evictions": bm.num_evictions, "max_used": max_used,
            "waited": max_waiting_with_running}


def test_outputs_equal_each_request_alone_on_a_roomy_engine(pressure, alone):
    got = [r["tokens"] for r in pressure["res"]]
    assert [len(t) for t in got] == [PARAMS.max_tokens] * len(alone)
    assert got == alone
    assert all(r["reason"] == "length" for r in pressure["res"])


def test_the_budget_really_was_too_small(pressure, prompts):
    # Together the requests need far more than 6 blocks: 4 x ceil((~38 + 20) / 16) = 16
    # without sharing; the pages were full at some step and requests had to wait.
    need = sum(-(-(len(p) + PARAMS.max_tokens) // 16) for p in prompts)
    assert need > 2 * KV_BLOCKS
    assert pressure["max_used"] == KV_BLOCKS
    assert pressure["waited"] >= 1


def test_preemption_happened(pressure):
    assert pressure["stats"].num_preemptions_total >= 1


def test_eviction_happened(pressure):
    assert pressure["evictions"] >= 1


def test_prefix_reuse_happened(pressure, prompts):
    stats = pressure["stats"]
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts)
    # Requests admitted after the first one found the shared 32-token prefix cached.
    assert stats.prefix_hit_tokens_total >= 32
    hits = [r["cached"] for r in pressure["res"]]
    assert hits[0] == 0                        # the first request had nothing to reuse
    assert any(h >= 32 for h in hits[1:])
    assert all(h % 16 == 0 for h in hits)      # whole blocks only


def test_everything_is_released_at_the_end(engines, pressure):
    tight = engines[1]
    bm = tight.block_manager
    assert tight.stats().kv_blocks_used == 0
    assert bm.ref_count == [0] * KV_BLOCKS
    assert bm.num_free_blocks == KV_BLOCKS
    assert not tight.seqs
