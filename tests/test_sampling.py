"""The sampler (mooncaked/model/sampling.py) on hand-made logits: exact semantics of
top-p, top-k, min-p, temperature, the three penalties, greedy, seeded draws and logprobs,
checked against the definitions in vLLM's v1 sampler:

- vllm/v1/sample/sampler.py (Sampler: raw logprobs first, then penalties, then greedy
  argmax or temperature -> argmax-invariant logits processors (min-p) -> top-k/top-p),
- vllm/v1/sample/logits_processor/builtin.py (MinPLogitsProcessor.apply),
- vllm/v1/sample/ops/topk_topp_sampler.py (apply_top_k_top_p, apply_top_k_only),
- vllm/model_executor/layers/utils.py (apply_penalties: frequency and presence) and
  vllm/_custom_ops.py (apply_repetition_penalties_torch).

Most cases use LOGITS, an 8-token row whose softmax is exactly dyadic in fp32 (checked),
so cumulative masses such as 0.5 and 0.75 are exact and the top-p boundary is tested
without rounding luck.
"""

from __future__ import annotations

import math

import pytest
import torch

from mooncaked.engine.types import InvalidRequest, SamplingParams
from mooncaked.model.sampling import SamplingRow, apply_penalties, sample, sampling_probs

LN2 = math.log(2.0)
NEG = -1e4                      # exp underflows to exactly 0 in fp32
# token:           0      1    2      3       4    5    6       7
LOGITS = torch.tensor([LN2, 0.0, NEG, 3 * LN2, NEG, 0.0, 2 * LN2, NEG], dtype=torch.float32)
PROBS = torch.tensor([0.125, 0.0625, 0.0, 0.5, 0.0, 0.0625, 0.25, 0.0], dtype=torch.float32)
# Order by probability: 3 (0.5), 6 (0.25), 0 (0.125), then 1 and 5 tied (0.0625 each).


def params(**kw) -> SamplingParams:
    """Sampling params with temperature 1 unless given (no filter, no penalty)."""
    return SamplingParams(**{"temperature": 1.0, **kw})


def kept(probs: torch.Tensor) -> set[int]:
    """Token ids with non-zero probability."""
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_the_hand_made_distribution_is_exact():
    assert torch.equal(torch.softmax(LOGITS, dim=-1), PROBS)
    assert torch.equal(sampling_probs(LOGITS, params()), PROBS)   # no filter: plain softmax


# ---------------------------------------------------------------------------- top-p


@pytest.mark.parametrize("top_p, survivors", [
    (1e-9, {3}),                   # tiny p: the most likely token is always kept
    (0.3, {3}),
    (0.5, {3}),                    # boundary: mass of {3} == p exactly -> 6 is dropped
    (0.5 + 1e-6, {3, 6}),
    (0.7, {3, 6}),
    (0.75, {3, 6}),                # boundary: mass of {3, 6} == 0.75 -> 0 is dropped
    (0.75 + 1e-6, {3, 6, 0}),
    (0.875, {3, 6, 0}),            # boundary again
    (1.0, {3, 6, 0, 1, 5}),        # off
])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p(top_p, survivors):
    """vLLM apply_top_k_top_p: sort ascending, drop tokens whose ascending cumulative
    probability is <= 1 - p, never the last (most likely) one. Equivalently, from the most
    likely token down, a token survives iff the mass strictly before it is < p; so when
    the mass of the first j tokens equals p exactly, token j+1 is dropped."""
    probs = sampling_probs(LOGITS, params(top_p=top_p))
    assert kept(probs) == survivors
    # survivors keep their relative weights, renormalised to sum 1
    mass = PROBS[sorted(survivors)].sum()
    torch.testing.assert_close(probs, torch.where(probs > 0, PROBS / mass, 0.0), rtol=1e-6, atol=0)


def test_top_p_tie_at_the_cut_keeps_exactly_one_of_the_tied_tokens():
    """Tokens 1 and 5 tie (0.0625 each) right where p = 0.9 cuts: exactly one of them
    survives. Which one is the sort order's choice, unspecified here as in vLLM."""
    survivors = kept(sampling_probs(LOGITS, params(top_p=0.9)))
    assert {3, 6, 0} < survivors and len(survivors) == 4 and len(survivors & {1, 5}) == 1


def test_top_p_is_computed_after_top_k_renormalises():
    """top-k 2 leaves {3: 2/3, 6: 1/3}; p = 0.6 is reached by token 3 alone (2/3 >= 0.6),
    so 6 goes. On the unfiltered distribution it would have stayed (0.5 < 0.6)."""
    assert kept(sampling_probs(LOGITS, params(top_k=2, top_p=0.6))) == {3}
    assert kept(sampling_probs(LOGITS, params(top_p=0.6))) == {3, 6}


# ---------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("top_k, survivors", [
    (1, {3}),
    (2, {3, 6}),
    (3, {3, 6, 0}),
    (4, {3, 6, 0, 1, 5}),          # tie with the 4th largest: both tied tokens are kept
    (5, {3, 6, 0, 1, 5}),
    (8, {3, 6, 0, 1, 5}),          # k = vocab: off
    (0, {3, 6, 0, 1, 5}),          # off
    (-1, {3, 6, 0, 1, 5}),         # off
])
def test_top_k_keeps_the_k_largest_and_everything_tied_with_the_kth(top_k, survivors):
    """vLLM masks `logit < k-th largest logit`, so ties with the k-th value all survive
    (more than k tokens may survive; never fewer)."""
    probs = sampling_probs(LOGITS, params(top_k=top_k))
    assert kept(probs) == survivors
    mass = PROBS[sorted(survivors)].sum()
    torch.testing.assert_close(probs, torch.where(probs > 0, PROBS / mass, 0.0), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------- min-p


@pytest.mark.parametrize("min_p, survivors", [
    (1.0, {3}),                    # only the most likely token(s)
    (0.5 + 1e-6, {3}),
    (0.5, {3, 6}),                 # 0.25 == 0.5 * 0.5: equal to the threshold is kept
    (0.25, {3, 6, 0}),
    (0.125, {3, 6, 0, 1, 5}),
    (0.0, {3, 6, 0, 1, 5}),        # off
])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, survivors):
    """vLLM MinPLogitsProcessor: drop tokens with prob < min_p * max prob."""
    assert kept(sampling_probs(LOGITS, params(min_p=min_p))) == survivors


def test_min_p_applies_before_top_p():
    """vLLM runs min-p (an argmax-invariant logits processor) before top-k/top-p. min-p 0.25
    leaves {3, 6, 0} = {4/7, 2/7, 1/7}; then p = 0.8 is reached after 3 and 6 (6/7), so 0
    goes. Top-p first on the full distribution would keep 0 (0.75 < 0.8)."""
    assert kept(sampling_probs(LOGITS, params(min_p=0.25, top_p=0.8))) == {3, 6}


def test_min_p_uses_the_temperature_scaled_distribution():
    """At T = 0.5 probabilities go as p^2: 0.25 / 0.0625 ... token 6 has 1/4 of the top
    token's probability (0.25/0.5 squared), so min_p 0.3 drops it; at T = 1 it has 1/2."""
    assert kept(sampling_probs(LOGITS, params(min_p=0.3))) == {3, 6}
    assert kept(sampling_probs(LOGITS, params(min_p=0.3, temperature=0.5))) == {3}


# ---------------------------------------------------------------------------- temperature


ROW = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, -2.5, 1.5, 0.25], dtype=torch.float32)


@pytest.mark.parametrize("temperature", [0.25, 0.5, 0.7, 1.0, 1.3, 2.0])
def test_temperature_distribution_is_softmax_of_logits_over_t(temperature):
    probs = sampling_probs(ROW, params(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(ROW / temperature, dim=-1), rtol=1e-6, atol=1e-9)
    assert probs.dtype == torch.float32 and abs(float(probs.sum()) - 1.0) < 1e-6


def test_temperature_closed_form():
    """softmax(l / T) = p^(1/T) renormalised: logits [ln 3, 0] at T = 0.5 give [9, 1] / 10."""
    two = torch.tensor([math.log(3.0), 0.0])
    torch.testing.assert_close(sampling_probs(two, params(temperature=0.5)),
                               torch.tensor([0.9, 0.1]), rtol=1e-6, atol=0)
    torch.testing.assert_close(sampling_probs(two, params(temperature=2.0)),
                               torch.tensor([3 ** 0.5, 1.0]) / (3 ** 0.5 + 1), rtol=1e-6, atol=0)


def test_sampling_probs_refuses_temperature_zero():
    with pytest.raises(ValueError):
        sampling_probs(ROW, params(temperature=0.0))


def test_draws_follow_sampling_probs():
    """4000 seeded draws through sample(): filtered tokens are never drawn and frequencies
    fit sampling_probs (chi-square below the 1e-6 tail of chi2 with 3 degrees of freedom,
    about 30.7; seeds are fixed, so this is deterministic)."""
    p = params(temperature=0.7, top_k=4, min_p=0.02)
    want = sampling_probs(ROW, p)
    assert kept(want) == {0, 2, 3, 6}
    n = 4000
    counts = torch.zeros(8)
    for seed in range(n):
        (tok,), _ = sample(ROW.clone().unsqueeze(0), [SamplingRow(params(temperature=0.7, top_k=4,
                                                                        min_p=0.02, seed=seed), [1], 1)])
        counts[tok] += 1
    assert kept(counts) <= kept(want)
    exp = want * n
    nz = exp > 0
    chi2 = float((((counts - exp) ** 2)[nz] / exp[nz]).sum())
    assert chi2 < 30.7, (counts.tolist(), exp.tolist())


# ---------------------------------------------------------------------------- vLLM reference


def vllm_reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM v1's random-sampling distribution for one row, transcribed from
    Sampler.apply_temperature, MinPLogitsProcessor.apply and apply_top_k_top_p /
    apply_top_k_only (fp32 parameter tensors, as vLLM holds them)."""
    x = logits.clone().float().unsqueeze(0)
    x.div_(torch.tensor([p.temperature], dtype=torch.float32).unsqueeze(1))
    if p.min_p:
        probability_values = torch.nn.functional.softmax(x, dim=-1)
        max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
        adjusted_min_p = max_probabilities.mul_(torch.tensor([[p.min_p]], dtype=torch.float32))
        x[probability_values < adjusted_min_p] = -float("inf")
    k = torch.tensor([p.top_k]) if 0 < p.top_k < x.shape[1] else None
    top_p = torch.tensor([p.top_p], dtype=torch.float32) if p.top_p < 1.0 else None
    if top_p is None and k is not None:                    # apply_top_k_only
        kth = x.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        x.masked_fill_(x < kth, -float("inf"))
    elif top_p is not None:                                # apply_top_k_top_p
        logits_sort, logits_idx = x.sort(dim=-1, descending=False)
        if k is not None:
            top_k_mask = logits_sort.size(1) - k.to(torch.long)
            top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
            logits_sort.masked_fill_(logits_sort < top_k_mask, -float("inf"))
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1)
        top_p_mask = probs_sum <= 1 - top_p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
        x = logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)
    return x.softmax(dim=-1, dtype=torch.float32)[0]


def test_random_cases_equal_the_vllm_reference_exactly():
    g = torch.Generator().manual_seed(20240601)
    for case in range(300):
        vocab = 6 + case % 5
        logits = torch.randn(vocab, generator=g) * 2.5
        if case % 7 == 0:
            logits[int(torch.randint(vocab, (1,), generator=g))] = logits.max()   # a tie at the top
        u = torch.rand(4, generator=g).tolist()
        p = params(temperature=round(0.2 + 1.6 * u[0], 3),
                   top_k=int(u[1] * (vocab + 2)) - 1,
                   top_p=1.0 if u[2] > 0.8 else round(max(u[2] / 0.8, 1e-3), 4),
                   min_p=0.0 if u[3] > 0.6 else round(u[3] / 2, 4))
        got, want = sampling_probs(logits, p), vllm_reference_probs(logits, p)
        assert torch.equal(got, want), (case, p, got, want)


# ---------------------------------------------------------------------------- penalties


PEN = torch.tensor([2.0, -1.0, 0.0, 3.0, 0.5, -0.5, 1.0, 4.0], dtype=torch.float32)
PROMPT = [0, 1, 2]
OUTPUT = [4, 4, 5, 4]


def penalised(p: SamplingParams, prompt=PROMPT, output=OUTPUT) -> torch.Tensor:
    return apply_penalties(PEN.clone(), SamplingRow(p, prompt + output, len(prompt)))


def test_repetition_penalty_divides_positive_and_multiplies_non_positive_logits():
    """vllm apply_repetition_penalties_torch: for tokens in prompt OR output, logit > 0 is
    divided by r (vLLM multiplies by 1/r), logit <= 0 multiplied by r. vLLM puts logit == 0
    on the multiply side; 0 * r and 0 / r are both 0, so the value stays 0 either way (token
    2 below). Other tokens are untouched. r = 2 and 0.5 are exact in fp32; r = 1.3 is
    checked to 1e-6 relative (x / r and x * (1 / r) may differ in the last bit)."""
    got = penalised(params(repetition_penalty=2.0))
    assert got.tolist() == [1.0, -2.0, 0.0, 3.0, 0.25, -1.0, 1.0, 4.0]
    got = penalised(params(repetition_penalty=0.5))        # r < 1 encourages repeats
    assert got.tolist() == [4.0, -0.5, 0.0, 3.0, 1.0, -0.25, 1.0, 4.0]
    got = penalised(params(repetition_penalty=1.3))
    want = PEN.clone()
    for t in {0, 1, 2, 4, 5}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_repetition_penalty_counts_prompt_tokens_without_any_output():
    got = penalised(params(repetition_penalty=2.0), prompt=[0, 3, 3], output=[])
    assert got.tolist() == [1.0, -1.0, 0.0, 1.5, 0.5, -0.5, 1.0, 4.0]


def test_frequency_penalty_subtracts_f_times_the_count_in_the_output_only():
    """OpenAI / vllm apply_penalties: logits -= f * output_bin_counts; prompt tokens (0, 1, 2)
    do not count."""
    got = penalised(params(frequency_penalty=0.5))
    assert got.tolist() == [2.0, -1.0, 0.0, 3.0, 0.5 - 1.5, -0.5 - 0.5, 1.0, 4.0]
    got = penalised(params(frequency_penalty=-0.25))                  # negative: encourages
    assert got.tolist() == [2.0, -1.0, 0.0, 3.0, 0.5 + 0.75, -0.5 + 0.25, 1.0, 4.0]
    # a token that is in the prompt and the output counts only its output occurrences
    got = penalised(params(frequency_penalty=1.0), prompt=[4, 4, 4], output=[4])
    assert got[4].item() == 0.5 - 1.0


def test_presence_penalty_subtracts_once_per_token_present_in_the_output():
    """logits -= q * [token in output]; repeats do not add up, prompt tokens do not count."""
    got = penalised(params(presence_penalty=0.75))
    assert got.tolist() == [2.0, -1.0, 0.0, 3.0, 0.5 - 0.75, -0.5 - 0.75, 1.0, 4.0]


def test_penalties_compose_in_vllm_order():
    """Repetition first (its sign test sees the raw logit), then frequency, then presence:
    token 4 (0.5, three times in the output) -> 0.5 / 2 - 0.5 * 3 - 0.75 = -2.0; token 5
    (-0.5, once) -> -0.5 * 2 - 0.5 - 0.75 = -2.25. Frequency before repetition would give
    token 4 (0.5 - 1.5) * 2 - 0.75 = -2.75."""
    got = penalised(params(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.75))
    assert got.tolist() == [1.0, -2.0, 0.0, 3.0, -2.0, -2.25, 1.0, 4.0]


def test_sample_applies_penalties_in_place_and_only_to_rows_that_ask():
    logits = torch.stack([PEN.clone(), PEN.clone()])
    rows = [SamplingRow(params(temperature=0.0, repetition_penalty=2.0), PROMPT + OUTPUT, 3),
            SamplingRow(params(temperature=0.0), PROMPT + OUTPUT, 3)]
    sample(logits, rows)
    assert logits[0].tolist() == [1.0, -2.0, 0.0, 3.0, 0.25, -1.0, 1.0, 4.0]
    assert torch.equal(logits[1], PEN)


# ---------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_of_the_penalised_logits():
    raw = PEN.clone()
    assert int(torch.argmax(raw)) == 7
    # 7 is in the output: repetition 2 halves it to 2.0, so 3 (3.0) wins
    (tok,), _ = sample(raw.clone().unsqueeze(0),
                       [SamplingRow(params(temperature=0.0, repetition_penalty=2.0), [7, 1], 1)])
    assert tok == 3
    # frequency: 7 generated three times at 0.5 each: 4.0 - 1.5 = 2.5 < 3.0
    (tok,), _ = sample(raw.clone().unsqueeze(0),
                       [SamplingRow(params(temperature=0.0, frequency_penalty=0.5), [1, 7, 7, 7], 1)])
    assert tok == 3
    # a mixed batch: the plain greedy row still takes the raw argmax
    toks, _ = sample(torch.stack([raw.clone(), raw.clone()]),
                     [SamplingRow(params(temperature=0.0), [7, 1], 1),
                      SamplingRow(params(temperature=0.0, presence_penalty=2.0), [1, 7], 1)])
    assert toks == [7, 3]


def test_top_k_one_is_greedy_whatever_the_temperature():
    for seed in range(20):
        (tok,), _ = sample(ROW.clone().unsqueeze(0),
                           [SamplingRow(params(temperature=2.0, top_k=1, seed=seed), [0], 1)])
        assert tok == 3


# ---------------------------------------------------------------------------- seeds


FLAT = torch.zeros(10)          # uniform: every draw is informative


def draw(seed: int, prompt: list[int], output: list[int], others: int = 0, logits=FLAT) -> int:
    """The seeded row's token, sampled in a batch after `others` unseeded rows."""
    rows = [SamplingRow(params(), [1, 2], 2) for _ in range(others)]
    rows.append(SamplingRow(params(seed=seed), prompt + output, len(prompt)))
    toks, _ = sample(logits.repeat(len(rows), 1), rows)
    return toks[-1]


def test_same_seed_and_output_position_give_the_same_token():
    """The generator is seeded from (seed, output position) only: the same token whatever
    the prompt, the earlier output tokens, the batch around it or the global RNG state."""
    for seed in range(40):
        a = draw(seed, [1, 2, 3], [4, 5])
        torch.manual_seed(seed + 1000)                    # the global RNG does not matter
        assert draw(seed, [9, 9, 9, 9], [0, 0], others=3) == a
        assert draw(seed, [1, 2, 3], [4, 5]) == a


def test_different_seeds_or_positions_give_different_draws():
    at0 = [draw(s, [1], []) for s in range(40)]
    at1 = [draw(s, [1], [7]) for s in range(40)]
    assert len(set(at0)) >= 5                              # uniform over 10 tokens
    assert at0 != at1
    assert SamplingRow(params(), [1], 1).generator is None


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_the_raw_logits():
    """vLLM's default logprobs_mode 'raw_logprobs': computed before penalties and
    temperature. The sampled token's logprob and the top-N alternatives (ids in rank
    order 1..N, strictly by raw logprob) match log_softmax(raw logits) within 1e-6."""
    raw = PEN.clone()
    ref = torch.log_softmax(raw.double(), dim=-1)
    rows = [SamplingRow(params(temperature=0.0, repetition_penalty=2.0, logprobs=3), [7, 1], 1),
            SamplingRow(params(temperature=0.5, top_k=2, seed=3, logprobs=0), [0], 1),
            SamplingRow(params(temperature=0.0), [0], 1)]
    toks, lps = sample(raw.repeat(3, 1), rows)
    assert toks[0] == 3                      # sampled from the penalised logits ...
    first = lps[0]
    assert first.token_id == 3
    assert abs(first.logprob - float(ref[3])) < 1e-6       # ... but reported raw
    assert [t for t, _ in first.top] == [7, 3, 0]          # ranks 1, 2, 3 of the raw logits
    for t, v in first.top:
        assert abs(v - float(ref[t])) < 1e-6
    assert first.top[0][1] > first.top[1][1] > first.top[2][1]
    second = lps[1]
    assert second.top == [] and second.token_id == toks[1] and toks[1] in (7, 3)
    assert abs(second.logprob - float(ref[toks[1]])) < 1e-6
    assert lps[2] is None


def test_logprobs_of_a_greedy_token_is_the_top_alternative():
    (tok,), (lp,) = sample(ROW.clone().unsqueeze(0), [SamplingRow(params(temperature=0.0, logprobs=5), [0], 1)])
    ref = torch.log_softmax(ROW.double(), dim=-1)
    assert tok == 3 and lp.top[0][0] == 3 and lp.top[0][1] == lp.logprob
    assert [t for t, _ in lp.top] == torch.argsort(ref, descending=True)[:5].tolist()
    assert max(abs(v - float(ref[t])) for t, v in lp.top) < 1e-6
    assert abs(sum(math.exp(float(x)) for x in ref) - 1.0) < 1e-9


# ---------------------------------------------------------------------------- resumed requests


def test_output_offset_counts_the_prompts_tail_as_output():
    """A request resumed with its first outputs appended to the prompt
    (SamplingParams.output_offset = how many) gets the same penalties and the same seeded
    draw as the undisturbed request; without the offset it gets neither."""
    p = {"frequency_penalty": 0.5, "presence_penalty": 0.75, "repetition_penalty": 2.0}
    want = penalised(params(**p))
    resumed = PROMPT + OUTPUT[:2]
    got = penalised(params(**p, output_offset=2), prompt=resumed, output=OUTPUT[2:])
    assert got.tolist() == want.tolist()
    assert penalised(params(**p), prompt=resumed, output=OUTPUT[2:]).tolist() != want.tolist()
    for seed in range(20):
        g = SamplingRow(params(seed=seed), PROMPT + OUTPUT, len(PROMPT)).generator
        r = SamplingRow(params(seed=seed, output_offset=2), PROMPT + OUTPUT, len(PROMPT) + 2)
        assert torch.equal(g.get_state(), r.generator.get_state())
    with pytest.raises(InvalidRequest, match="output_offset"):
        params(output_offset=-1).validate()
