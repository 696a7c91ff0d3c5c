"""The engine in-process: prefix caching, preemption, chunked prefill, sampling, stop strings."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from mooncaked.engine.detokenizer import IncrementalDetokenizer
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.stop import held_back
from mooncaked.engine.types import InvalidRequest, SamplingParams, StructuredSpec

from mooncaked.config import load_settings


def make_settings(**overrides):
    return load_settings(None, overrides)

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?",
             "Write one sentence about cats.", "Who wrote Hamlet?", "What is water made of?"]


MAX_STEPS = 10_000   # far above any test's need: a stuck scheduler fails, not hangs


def step_all(engine: LLMEngine, max_steps: int = MAX_STEPS) -> list:
    """Steps the engine until it has no work; returns every output. Fails after max_steps."""
    outs = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        outs += engine.step()
    raise AssertionError(f"engine still has work after {max_steps} steps")


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, salt=None) -> list[dict]:
    """Runs prompts to completion together; returns per request tokens, text, cached tokens."""
    res = {}
    for i, p in enumerate(prompts):
        rid = f"r{id(prompts)}-{i}"
        engine.add_request(rid, p, params, salt)
        res[rid] = {"tokens": [], "text": "", "cached": None, "reason": None}
    order = list(res)
    for out in step_all(engine):
        r = res[out.request_id]
        r["tokens"] += out.new_token_ids
        r["text"] += out.new_text
        r["cached"] = out.num_cached_tokens
        r["reason"] = out.finish_reason
    return [res[k] for k in order]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(make_settings(**{"engine.max_num_batched_tokens": 256, "engine.idle_prefill_tokens": 0}))


@pytest.fixture(scope="module")
def chats(engine):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
# Long enough that every request's KV grows past a block boundary while decoding.
GROW = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(engine, chats):
    """Each chat's greedy GROW output, run on its own."""
    return [run(engine, [c], GROW)[0]["tokens"] for c in chats[:4]]


def test_prefix_cache_hit_gives_same_greedy_output(engine):
    # A prompt no other test sends (the module's engine and its prefix cache are shared).
    long = engine.tokenizer.encode("Prefix cache check: say why the sky is blue. "
                                   "Also, explain why in detail please." * 4)
    (cold,) = run(engine, [long], GREEDY)
    (warm,) = run(engine, [long], GREEDY)
    assert cold["cached"] == 0
    # every full block except the one holding the last prompt token (always computed)
    assert warm["cached"] == 16 * ((len(long) - 1) // 16) > 0
    assert warm["tokens"] == cold["tokens"]


def test_cache_salt_separates_tenants(engine, chats):
    prompt = chats[1] + engine.tokenizer.encode(" Answer in French." * 5)
    (a,) = run(engine, [prompt], GREEDY, salt="tenant-a")
    (b,) = run(engine, [prompt], GREEDY, salt="tenant-b")
    (a2,) = run(engine, [prompt], GREEDY, salt="tenant-a")
    assert a["cached"] == b["cached"] == 0            # the salts are this test's own
    assert a2["cached"] == 16 * ((len(prompt) - 1) // 16) > 0
    assert a["tokens"] == b["tokens"] == a2["tokens"]


def test_batched_equals_alone_and_chunked_prefill(engine, chats, alone):
    together = [r["tokens"] for r in run(engine, chats[:4], GROW)]
    assert together == alone
    # A tiny step budget forces prefill in chunks interleaved with decodes.
    small = LLMEngine(make_settings(**{"engine.max_num_batched_tokens": 7,
                                       "engine.idle_prefill_tokens": 0}))
    assert [r["tokens"] for r in run(small, chats[:4], GROW)] == alone


def test_tiny_kv_budget_preempts_and_still_completes(engine, chats, alone):
    """KV room for two prompts but not their growth: all complete with their solo outputs."""
    assert all(len(c) <= 48 for c in chats[:4])  # 3 blocks each
    tight = LLMEngine(make_settings(**{"engine.kv_cache_bytes": engine.block_bytes * 6,
                                       "engine.enable_prefix_caching": False}))
    out = run(tight, chats[:4], GROW)
    assert [r["tokens"] for r in out] == alone
    assert tight.stats().num_preemptions_total > 0
    assert tight.stats().kv_blocks_used == 0


def test_seeded_sampling_is_reproducible(engine, chats):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = run(engine, [chats[3]], p)[0]["tokens"]
    b = run(engine, [chats[3]], p)[0]["tokens"]
    c = run(engine, [chats[3]], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0]["tokens"]
    assert a == b
    assert a != c


def test_resumed_seeded_request_continues_the_same_sequence(engine, chats):
    """A seeded, penalised request re-run as prompt + its first k outputs with
    output_offset = k (what the cluster front end does when a decode node dies) samples
    exactly the undisturbed request's remaining tokens (issue 18, fault 8)."""
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 4321, "presence_penalty": 0.6,
          "frequency_penalty": 0.4, "repetition_penalty": 1.2, "ignore_eos": True}
    whole = run(engine, [chats[4]], SamplingParams(max_tokens=16, **kw))[0]["tokens"]
    k = 6
    resumed = SamplingParams(max_tokens=16 - k, output_offset=k, **kw)
    assert run(engine, [chats[4] + whole[:k]], resumed)[0]["tokens"] == whole[k:]
    # without the offset the positions restart at 0 and the tail differs
    restarted = SamplingParams(max_tokens=16 - k, **kw)
    assert run(engine, [chats[4] + whole[:k]], restarted)[0]["tokens"] != whole[k:]
    with pytest.raises(InvalidRequest, match="output_offset"):
        engine.add_request("off", chats[4], SamplingParams(output_offset=len(chats[4])))


def test_resumed_structured_request_keeps_its_grammar_state(engine, chats):
    """The structured-output matcher of a resumed request replays the output_offset tokens:
    the constrained, seeded continuation equals the undisturbed one."""
    spec = StructuredSpec("regex", "(red|green|blue)( (red|green|blue)){5}")
    kw = {"temperature": 1.0, "seed": 11, "structured": spec}
    whole = run(engine, [chats[1]], SamplingParams(max_tokens=24, **kw))[0]["tokens"]
    k = 3
    assert len(whole) > k + 2
    resumed = SamplingParams(max_tokens=24 - k, output_offset=k, **kw)
    assert run(engine, [chats[1] + whole[:k]], resumed)[0]["tokens"] == whole[k:]


def test_top_k_one_and_min_p_one_equal_greedy(engine, chats):
    g = run(engine, [chats[2]], GREEDY)[0]["tokens"]
    assert run(engine, [chats[2]], SamplingParams(max_tokens=12, temperature=1.0, top_k=1))[0]["tokens"] == g
    assert run(engine, [chats[2]], SamplingParams(max_tokens=12, temperature=1.5, min_p=1.0))[0]["tokens"] == g


def test_penalties_change_repetitive_output(engine):
    prompt = engine.tokenizer.encode("the the the the the the the the")
    plain = run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]["tokens"]
    pen = run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                               repetition_penalty=1.8, frequency_penalty=1.5))[0]["tokens"]
    assert plain != pen
    # greedy repeats itself on this prompt; with the penalties no token comes twice
    assert len(set(plain)) < len(plain) and len(set(pen)) == len(pen) == 10


def test_logprobs_are_consistent(engine, chats):
    engine.add_request("lp", chats[0], SamplingParams(max_tokens=3, temperature=0.0, logprobs=5))
    outs = step_all(engine)
    assert sum(len(o.new_token_ids) for o in outs) == 3
    for o in outs:
        (lp,) = o.logprobs
        assert lp.logprob <= 0.0
        assert len(lp.top) == 5
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0][0] == lp.token_id and abs(lp.top[0][1] - lp.logprob) < 1e-5  # greedy


def test_stop_string_spanning_tokens(engine, chats):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 20, one number per line."}])
    full = run(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]["text"]
    stop = "4\n5."
    assert stop in full
    r = run(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert r["reason"] == "stop"
    assert r["text"] == full[: full.index(stop)]


def test_detokenizer_holds_back_possible_stop_prefix(engine):
    tok = engine.tokenizer
    ids = tok.encode("Hello world, goodbye moon")
    d = IncrementalDetokenizer(tok, ["goodbye moon"])
    sent = "".join(d.add(t) for t in ids)
    assert d.stopped == "goodbye moon"
    assert sent == "Hello world, "
    assert "goodbye" not in sent


def test_bad_requests_are_refused(engine):
    with pytest.raises(InvalidRequest):
        engine.add_request("e1", [], GREEDY)
    with pytest.raises(InvalidRequest):
        engine.add_request("e2", [1] * engine.max_model_len, GREEDY)
    with pytest.raises(InvalidRequest):
        engine.add_request("e3", [engine.cfg.vocab_size], GREEDY)
    with pytest.raises(InvalidRequest):
        engine.add_request("e4", [1, 2], SamplingParams(temperature=-1))
    assert not engine.has_work()


def _prefill_then_decode(engine, prompt, params, rid):
    """The disaggregated path at engine level: prefill (max_tokens=1, export_kv) on
    `engine`, decode with kv_import + first_token on another. Returns the prefill's final
    output and what a client gets: the first token with held_back of its text (as the
    API node sends it), then the decoder's outputs."""
    from mooncaked.engine.types import KVImport

    engine.add_request(f"p{rid}", prompt, dataclasses.replace(params, max_tokens=1),
                       export_kv=True)
    (final,) = [o for o in step_all(engine) if o.finished]
    exp = final.kv_export
    first = final.new_token_ids[0]
    decoder = engine_without_prefix_cache()
    decoder.add_request(f"d{rid}", prompt, params, kv_import=KVImport(exp.blocks.clone(), exp.num_tokens),
                        first_token=first)
    outs = step_all(decoder)
    assert len(outs[0].new_token_ids) == 1                # the first token is not sent again
    tokens = [first] + sum((o.new_token_ids for o in outs), [])
    text = held_back(final.new_text, params.stop) + "".join(o.new_text for o in outs)
    return final, tokens, text, outs[-1]


def test_a_stop_string_spanning_the_first_token_stops_the_decoder_as_one_engine(engine, chats):
    """The first token's text ends in the start of a stop string that the second token
    completes: the API node holds that part back, the decoder neither repeats it nor
    misses it, and stops where one engine stops."""
    prompt = chats[4] + engine.tokenizer.encode(" Answer briefly.")
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = run(engine, [prompt], plain)[0]
    t0, t1 = (engine.tokenizer.decode([t]) for t in base["tokens"][:2])
    assert t0 and t1, (t0, t1)
    stop = [t0[-1] + t1[:1]]
    assert held_back(t0, stop) == t0[:-1]                  # the first token's text is held back
    params = dataclasses.replace(plain, stop=stop)
    whole = run(engine, [prompt], params)[0]
    final, tokens, text, last = _prefill_then_decode(engine, prompt, params, "stop")
    assert final.finish_reason == "length"                 # the prefill alone did not stop
    assert tokens == whole["tokens"] and text == whole["text"]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop[0])
    assert text == (t0 + t1)[:(t0 + t1).index(stop[0])]


@pytest.mark.parametrize("seed", [None, 7])
def test_prefill_export_then_decode_import_equals_one_engine(engine, chats, seed):
    """The disaggregated path at engine level: prefill on one engine, decode on another.
    Greedy and seeded sampling give the same tokens as one engine; the decoder does not
    report the first token again."""
    from mooncaked.engine.types import KVImport

    prompt = chats[4] + engine.tokenizer.encode(" Answer briefly.")
    temp = 0.0 if seed is None else 1.0
    params = SamplingParams(max_tokens=10, temperature=temp, seed=seed, ignore_eos=True)
    whole = run(engine, [prompt], params)[0]

    engine.add_request(f"p{seed}", prompt, SamplingParams(max_tokens=1, temperature=temp, seed=seed),
                       export_kv=True)
    (final,) = [o for o in step_all(engine) if o.finished]
    exp = final.kv_export
    assert exp.num_tokens == len(prompt)
    assert exp.blocks.shape[0] == -(-len(prompt) // engine.block_size)
    assert len(exp.keys) == len(prompt) // engine.block_size
    first = final.new_token_ids[0]

    decoder = engine_without_prefix_cache()
    started = []                                    # on_start: a decode node's cue for token 1
    decoder.on_start = lambda rids: started.append((rids, decoder.last_step))
    decoder.add_request(f"d{seed}", prompt, params, kv_import=KVImport(exp.blocks.clone(), exp.num_tokens),
                        first_token=first)
    decoder.add_request(f"plain{seed}", prompt[:20], params)     # no hand-over: no cue
    tokens, text, cached = [first], held_back(final.new_text, []), None
    before = decoder.last_step
    outs = step_all(decoder)
    # once, for the continuation only, in its first step before the forward pass (the
    # step timing is still the previous step's)
    assert [r for r, _ in started] == [[f"d{seed}"]] and started[0][1] is before
    outs = [o for o in outs if o.request_id == f"d{seed}"]
    assert len(outs[0].new_token_ids) == 1          # the first token is not reported again
    for o in outs:
        tokens += o.new_token_ids
        text += o.new_text
        cached = o.num_cached_tokens
    assert tokens == whole["tokens"]
    assert text == whole["text"]
    assert cached == len(prompt)
    assert decoder.stats().kv_blocks_used == 0


def test_layerwise_stage_equals_gathered_export(engine, chats):
    """LayerwiseKV, staged layer by layer over chunked prefill steps with a prefix hit,
    holds exactly the blocks that export_kv gathers at the end."""
    prompt = (sum(chats, []) * 8)[:900]
    run(engine, [prompt[:384]], SamplingParams(max_tokens=1))       # warm a 384-token prefix
    calls = []
    ks = engine.layerwise_kv(len(prompt), lambda *a: calls.append(a[:3]))
    engine.add_request("layerwise", prompt, SamplingParams(max_tokens=1), export_kv=True,
                       kv_stream=ks)
    (final,) = [o for o in step_all(engine) if o.finished]
    assert final.num_cached_tokens == 384
    exp = final.kv_export
    assert ks.num_tokens == exp.num_tokens == len(prompt)
    assert torch.equal(ks.stage.permute(1, 0, 2, 3, 4, 5), exp.blocks)
    layers = engine.cfg.num_layers
    steps = [calls[i:i + layers] for i in range(0, len(calls), layers)]
    assert len(calls) == len(steps) * layers and len(steps) == 3     # 516 new tokens, budget 256
    for step in steps:
        assert [c[0] for c in step] == list(range(layers))            # each layer once, in order
    assert steps[0][0][1] == 0                                        # cached blocks go too
    assert [s[0][2] for s in steps] == [-(-640 // 16), -(-896 // 16), -(-900 // 16)]
    assert steps[1][0][1] == 640 // 16 and steps[2][0][1] == 896 // 16


_DECODER = []


def engine_without_prefix_cache() -> LLMEngine:
    """One shared decode-side engine (loading a model takes seconds)."""
    if not _DECODER:
        _DECODER.append(LLMEngine(make_settings(**{"engine.enable_prefix_caching": False})))
    return _DECODER[0]


def test_block_copies_use_the_attention_kernels_module(engine):
    """KV import/export copies go through the kernel module the attention uses (Triton
    on CUDA, cpu_ops on this CPU engine, whose block copies are the torch references),
    not a hard-wired one."""
    from mooncaked.kernels import cpu_ops, reference

    assert engine.runner.ops is engine.model.ops is cpu_ops
    assert cpu_ops.gather_blocks is reference.gather_blocks
    ids = [0, 2]
    before = engine.runner.read_blocks(ids)
    assert before.shape == (2, *engine.runner.kv_cache.shape[1:]) and before.is_contiguous()
    engine.runner.write_blocks(ids, before.flip(0))
    assert torch.equal(engine.runner.read_blocks(ids), before.flip(0))
    engine.runner.write_blocks(ids, before)           # leave the pages as they were


def test_schedule_returns_one_output_with_loads_and_preemptions():
    """Scheduler.schedule() alone (no model): decodes and prefill chunks with their token
    counts, the KV load of an admitted import (its kv_import consumed), and a preemption
    when pages run out."""
    from mooncaked.engine.block_manager import BlockManager
    from mooncaked.engine.handover import HandOver
    from mooncaked.engine.scheduler import Scheduler
    from mooncaked.engine.scheduler_output import SchedulerOutput
    from mooncaked.engine.sequence import Sequence
    from mooncaked.engine.types import KVImport

    bm = BlockManager(num_blocks=5, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = Sequence("a", list(range(6)), GREEDY, b"salt", 16, detokenizer=None)
    b = Sequence("b", list(range(100, 110)), GREEDY, b"salt", 16, detokenizer=None)
    given = torch.randn(2, 1, 2, 4, 1, 1)
    b.handover = HandOver(kv_import=KVImport(given, 8))
    sch.add(a)
    sch.add(b)

    def advance(out: SchedulerOutput) -> None:
        """What a step does to the scheduled sequences: K/V computed, tokens sampled."""
        for s in out.scheduled:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            if samples:
                s.seq.token_ids.append(7)

    out = sch.schedule()
    assert isinstance(out, SchedulerOutput)
    assert out.decodes == () and out.preempted == ()
    assert [(s.seq, s.num_new_tokens) for s in out.prefills] == [(a, 6), (b, 2)]
    assert out.scheduled == out.prefills and out.num_scheduled_tokens == 8
    (load,) = out.kv_loads
    assert load.seq is b and load.block_ids == tuple(b.block_table[:2])
    assert torch.equal(load.blocks, given)
    assert b.handover.kv_import is None                # consumed by the load
    assert bm.num_free_blocks == 0
    advance(out)
    for _ in range(2):                                 # both decode inside their last page
        out = sch.schedule()
        assert [(s.seq, s.num_new_tokens) for s in out.decodes] == [(a, 1), (b, 1)]
        assert out.prefills == () and out.kv_loads == () and out.preempted == ()
        advance(out)
    out = sch.schedule()                               # a needs a page: b (newest) goes
    assert [(s.seq, s.num_new_tokens) for s in out.decodes] == [(a, 1)]
    assert out.preempted == (b,) and out.prefills == ()
    assert b.block_table == [] and b.num_computed_tokens == 0 and sch.waiting[0] is b


def test_timed_steps_are_kept_by_kind(engine):
    """The calibration's samples (conductor/refit.py): a step of prefill chunks only as
    (new tokens, tokens cached before them, seconds), a step of decodes only as (batch,
    context tokens, seconds)."""
    engine.prefill_steps.clear()
    engine.decode_steps.clear()
    prompt = list(range(1000, 1100))                          # 100 tokens: one chunk
    run(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        salt="timed-steps")
    assert [(n, c) for n, c, _ in engine.prefill_steps] == [(100, 0)]
    # the prefill samples the first token; two decode steps make the other two
    assert [(b, c) for b, c, _ in engine.decode_steps] == [(1, 101), (1, 102)]
    assert all(s > 0 for *_, s in [*engine.prefill_steps, *engine.decode_steps])


def test_a_decode_step_records_the_gap_its_requests_saw(engine):
    """A pure decode step after another one with a request in common records the time
    from that step's end to its own: what happened between the steps (here 0.2 s of
    nothing) is part of the gap a client sees (issue 33). The first decode step after
    the prefill records its compute time."""
    engine.decode_steps.clear()
    engine.add_request("gap", list(range(2000, 2050)),
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "gaps")
    engine.step()                                   # the prefill (and first token)
    t0 = time.perf_counter()
    engine.step()                                   # decode 1
    first = time.perf_counter() - t0
    time.sleep(0.2)                                 # the gap under test, not a wait
    engine.step()                                   # decode 2
    (_, _, s1), (_, _, s2) = engine.decode_steps
    assert s1 <= first
    assert s2 >= 0.2
    assert not engine.has_work()


def test_a_prompt_with_one_token_left_to_compute_is_a_prefill_step(engine):
    """The same prompt again (its blocks cached, only its last token to compute): the step
    is a 1-token prefill, not a decode. It was counted as a decode (one new token), so a
    prefill node showed decode steps and a decode node fed them to its step model."""
    prompt = list(range(3000, 3065))        # 4 full blocks of 16 (cached again) and 1 token
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for rid in ("warm", "again"):
        engine.decode_steps.clear()
        engine.add_request(rid, prompt, params, "one-left")
        engine.step()
        assert not engine.has_work()
    st = engine.last_step
    assert (st.num_prefill_tokens, st.num_decode_seqs) == (1, 0), st
    assert not engine.decode_steps
