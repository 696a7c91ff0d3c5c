"""The token budget of a step with no running decode (`engine.idle_prefill_tokens`, issue 15).

The step budget (`engine.max_num_batched_tokens`) bounds how long a prefill chunk holds up
running decodes. With no sequence decoding there is nothing to protect, so a prompt larger
than the budget is prefilled in one step, up to `idle_prefill_tokens`; while a decode runs
it is chunked at the budget as before. Either way the greedy tokens are the same.
"""

from __future__ import annotations

import pytest

from mooncaked.config import load_settings
from mooncaked.engine.block_manager import BlockManager
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.scheduler import Scheduler
from mooncaked.engine.sequence import Sequence
from mooncaked.engine.types import SamplingParams

BUDGET = 64          # engine.max_num_batched_tokens of the test engines
IDLE = 2048          # engine.idle_prefill_tokens (the default)
LONG = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FOREVER = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)


def _engine(idle: int) -> tuple[LLMEngine, list[tuple[int, int, int]]]:
    """An engine with a 64-token step budget and `idle` as idle_prefill_tokens, and the list
    its steps append to: (decode tokens, prefill tokens, prefill sequences) per step."""
    eng = LLMEngine(load_settings(None, {"engine.max_num_batched_tokens": BUDGET,
                                         "engine.idle_prefill_tokens": idle}))
    log: list[tuple[int, int, int]] = []
    schedule = eng.scheduler.schedule

    def logged():
        out = schedule()
        log.append((sum(s.num_new_tokens for s in out.decodes),
                    sum(s.num_new_tokens for s in out.prefills), len(out.prefills)))
        return out

    eng.scheduler.schedule = logged
    return eng, log


def _until_first_token(eng: LLMEngine, rid: str) -> tuple[int, list[int]]:
    """Steps until request `rid` has its first token; returns (steps taken, its tokens)."""
    for n in range(1, 1000):
        toks = [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        if toks:
            return n, toks
    raise AssertionError(f"{rid} got no token in 1000 steps")


def _finish(eng: LLMEngine, rid: str, toks: list[int]) -> list[int]:
    """Steps until `rid` finished (aborting everything else at the end); returns its tokens."""
    for _ in range(1000):
        outs = eng.step()
        for o in outs:
            if o.request_id == rid:
                toks = toks + o.new_token_ids
                if o.finished:
                    return toks
    raise AssertionError(f"{rid} did not finish")


@pytest.fixture(scope="module")
def engines():
    return {"idle": _engine(IDLE), "never": _engine(0)}


@pytest.fixture(scope="module")
def prompt(engines):
    eng = engines["idle"][0]
    text = ("The lighthouse keeper counted the ships that passed each night and wrote their "
            "names in a book. ") * 12 + "Tell me what the keeper wrote on the last page."
    p = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    assert 3 * BUDGET < len(p) < IDLE, len(p)
    return p


@pytest.fixture(scope="module")
def alone(engines, prompt):
    """The prompt run on the idle engine with nothing else: (steps to its first token,
    the step log, its greedy tokens)."""
    eng, log = engines["idle"]
    log.clear()
    eng.add_request("alone", prompt, LONG, cache_salt="alone")
    steps, first = _until_first_token(eng, "alone")
    toks = _finish(eng, "alone", first)
    return steps, list(log), toks


def test_lone_prompt_is_prefilled_in_one_step_when_nothing_decodes(alone, prompt):
    steps, log, toks = alone
    assert steps == 1
    assert log[0] == (0, len(prompt), 1)             # the whole prompt, past the 64-token budget
    assert all(d <= BUDGET and p == 0 for d, p, _ in log[1:])   # then plain decode steps
    assert len(toks) == LONG.max_tokens


def test_prompt_is_chunked_at_the_budget_while_a_decode_runs(engines, prompt, alone):
    eng, log = engines["idle"]
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    eng.add_request("decoder", chat, FOREVER, cache_salt="decoder")
    _until_first_token(eng, "decoder")                # now it decodes, one token a step
    log.clear()
    eng.add_request("joined", prompt, LONG, cache_salt="joined")
    steps, first = _until_first_token(eng, "joined")
    chunks = [p for _, p, n in log if n]
    assert steps == len(chunks) > 1
    assert sum(chunks) == len(prompt)
    # every step of the prefill kept the budget: the decode's token plus a chunk of 63
    assert all(d == 1 and d + p <= BUDGET for d, p, _ in log)
    assert chunks[:-1] == [BUDGET - 1] * (len(chunks) - 1)
    toks = _finish(eng, "joined", first)
    eng.abort("decoder")
    while eng.has_work():
        eng.step()
    assert toks == alone[2]            # same greedy tokens, chunked or not


def test_idle_budget_zero_always_chunks_and_gives_the_same_tokens(engines, prompt, alone):
    eng, log = engines["never"]
    log.clear()
    eng.add_request("never", prompt, LONG, cache_salt="never")
    steps, first = _until_first_token(eng, "never")
    assert steps == -(-len(prompt) // BUDGET)
    assert all(p <= BUDGET for _, p, _ in log)
    assert _finish(eng, "never", first) == alone[2]


def _seq(name: str, n: int) -> Sequence:
    return Sequence(name, list(range(1000, 1000 + n)), LONG, b"salt", 8, detokenizer=None)


def _advance(out) -> None:
    """What a step does to the scheduled sequences: K/V computed, a token sampled at the end."""
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.token_ids.append(7)


def test_idle_budget_bounds_a_step_and_the_pages_still_bound_admission():
    """Scheduler alone (no model): with nothing decoding a prompt runs in chunks of the idle
    budget (not more: it bounds a step's activations); once a decode runs, the step budget
    again; and a larger budget never hands out more pages than there are (a prompt that
    does not fit beside a running one waits, holding none)."""
    bm = BlockManager(num_blocks=80, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, idle_prefill_tokens=100)
    a = _seq("a", 250)
    sch.add(a)
    chunks = []
    while a.is_prefilling or not a.num_computed_tokens:
        out = sch.schedule()
        chunks.append(out.num_scheduled_tokens)
        _advance(out)
    assert chunks == [100, 100, 50]
    assert len(a.block_table) == -(-250 // 4) and bm.num_free_blocks == 80 - 63
    b = _seq("b", 40)                                 # a decodes now: b is chunked at 16
    sch.add(b)
    out = sch.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.decodes] == [(a, 1)]
    assert [(s.seq, s.num_new_tokens) for s in out.prefills] == [(b, 15)]
    sch.remove(a)
    sch.remove(b)
    assert bm.num_free_blocks == 80
    sch.idle_budget = 400
    c, d = _seq("c", 60), _seq("d", 300)              # pages for 320 tokens: not both
    sch.add(c)
    sch.add(d)
    out = sch.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.prefills] == [(c, 60)]
    assert list(sch.waiting) == [d] and d.block_table == [] and bm.num_free_blocks == 80 - 15
    _advance(out)
    out = sch.schedule()                              # c decodes: d joins in a 15-token chunk
    assert [(s.seq, s.num_new_tokens) for s in out.decodes] == [(c, 1)]
    assert [(s.seq, s.num_new_tokens) for s in out.prefills] == [(d, 15)]


def test_idle_budget_below_the_step_budget_keeps_the_step_budget():
    sch = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8,
                    max_num_batched_tokens=16, idle_prefill_tokens=0)
    a = _seq("a", 40)
    sch.add(a)
    assert sch.schedule().num_scheduled_tokens == 16
