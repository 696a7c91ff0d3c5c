"""Next-token selection: penalties, temperature, top-k, top-p, min-p, seeded sampling.

Semantics follow vLLM's v1 sampler (vllm/v1/sample/sampler.py, ops/penalties.py,
ops/topk_topp_sampler.py, logits_processor/builtin.py): penalties first
(repetition on prompt and output tokens; frequency and presence on output tokens),
then greedy argmax of the penalised logits, or temperature scaling, min-p, top-k and
top-p filtering (in that order) and a multinomial draw from the renormalised
distribution (`sampling_probs`) with a generator seeded from (request seed, output
position), so a seeded request samples the same tokens wherever its steps run (one
engine, or a prefill node then a decode node). Logprobs come from the raw model
distribution (log_softmax of the unmodified logits), like vLLM's default
`raw_logprobs` mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.engine.types import SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    """One sequence's inputs to sampling.

    token_ids: prompt + output so far (for the repetition penalty); num_prompt_tokens
    splits it, less params.output_offset (the prompt's tail that is the request's own
    output from before a resume): the output starts at `output_start`. With
    params.seed set, the draw for output position p uses a generator seeded from
    (seed, p); without, torch's global generator.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_start(self) -> int:
        """Index in token_ids of the request's first output token (a resumed request's
        earlier output counts: params.output_offset)."""
        return max(0, self.num_prompt_tokens - self.params.output_offset)

    @property
    def generator(self) -> torch.Generator | None:
        """A generator for this row's draw: seeded per (request seed, output position)."""
        seed = self.params.seed
        if seed is None:
            return None
        position = len(self.token_ids) - self.output_start
        return torch.Generator().manual_seed((seed * 1_000_003 + position) % (1 << 63))


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Applies the row's penalties to one row of logits, in place, as vLLM does.

    Repetition penalty r != 1 (vllm apply_repetition_penalties_torch): every token in the
    prompt or the output has its logit l replaced by l / r if l > 0, else by l * r (so a
    logit of exactly 0 stays 0). Then frequency f and presence q (OpenAI's definition,
    vllm apply_penalties): l -= f * count(token in output) + q * [token in output]; prompt
    tokens do not count for these two (a resumed request's earlier output, the prompt's
    last params.output_offset tokens, does).

    Args:
        logits: [vocab] float tensor (fp32 in the engine); modified in place.
        row: the row's params, token ids (prompt + output) and prompt length.
    Returns: `logits` (the same tensor).
    """
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    start = row.output_start
    if (p.presence_penalty or p.frequency_penalty) and len(row.token_ids) > start:
        out = torch.tensor(row.token_ids[start:], dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy draw samples from, as vLLM's v1 sampler builds it.

    Steps, in vLLM's order: divide by temperature; min-p drops tokens whose probability
    (of softmax(logits / T)) is below min_p * the largest probability; top-k keeps the
    k largest logits and every token tied with the k-th (vLLM masks `logit < k-th
    largest`); top-p sorts ascending, takes the cumulative sum of the (top-k
    renormalised) probabilities and drops every token whose ascending cumulative mass is
    <= 1 - top_p, always keeping the most likely one. Equivalently, going from the most
    likely token down, a token is kept while the mass before it is < top_p, so the kept
    set is the smallest prefix whose mass reaches top_p. Finally softmax over the
    survivors (dropped tokens get probability exactly 0).

    Args:
        logits: [vocab] float tensor, penalties already applied; not modified.
        params: temperature > 0 (greedy rows never get here), top_k (<= 0: off),
            top_p in (0, 1] (1: off), min_p in [0, 1] (0: off).
    Returns: fp32 [vocab] probabilities summing to 1.
    Raises: ValueError if params.temperature <= 0.
    """
    if params.temperature <= 0.0:
        raise ValueError(f"sampling_probs needs temperature > 0, got {params.temperature}")
    logits = logits.to(torch.float32) / params.temperature
    ninf = float("-inf")
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), ninf)
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, ninf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        # 1 - p in fp32, as vLLM computes it from its fp32 top_p tensor
        drop = cum <= 1.0 - torch.tensor(params.top_p, dtype=torch.float32)
        drop[-1] = False                      # at least one token survives
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, ninf))
    return torch.softmax(logits, dim=-1)


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """One row's token: argmax when greedy, else a draw from sampling_probs (penalised logits)."""
    p = row.params
    if p.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, p), 1, generator=row.generator))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Picks one token per row.

    Args:
        logits: fp32 [N, vocab] (modified in place by penalties).
        rows: N SamplingRow, in the same order.
    Returns: (token ids [N], logprobs [N]; an entry is None when its request asked for none).
    """
    wants_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
    plain_greedy = all(r.params.greedy and r.params.repetition_penalty == 1.0
                       and not r.params.presence_penalty and not r.params.frequency_penalty for r in rows)
    if plain_greedy:
        tokens = torch.argmax(logits, dim=-1).tolist()
    else:
        tokens = [_sample_row(apply_penalties(logits[i], r), r) for i, r in enumerate(rows)]
    out: list[TokenLogprob | None] = []
    for i, r in enumerate(rows):
        if not wants_logprobs[i]:
            out.append(None)
            continue
        lp = raw_logprobs[i]
        top: list[tuple[int, float]] = []
        if r.params.logprobs:
            vals, ids = torch.topk(lp, r.params.logprobs)
            top = list(zip(ids.tolist(), vals.tolist()))
        out.append(TokenLogprob(tokens[i], float(lp[tokens[i]]), top))
    return tokens, out


def score_tokens(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Prompt logprobs: how likely each given token was under the row before it.

    Row i of `logits` is the model's output at the position before token_ids[i]. The
    values are raw logprobs (log_softmax of the unmodified fp32 logits, vLLM's
    `raw_logprobs`); the rank is vLLM's (the number of tokens whose logprob is >= the
    token's own, so ties rank it last), and the top k alternatives come most likely first.

    Args:
        logits: fp32 [R, vocab]; not modified.
        token_ids: R token ids in [0, vocab).
        k: alternatives per row (0: none).
    Returns: R TokenLogprob with rank set.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, ids)                                   # [R, 1]
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    top_vals = top_ids = None
    if k:
        top_vals, top_ids = torch.topk(lp, k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for i, (t, v) in enumerate(zip(token_ids, chosen.squeeze(1).tolist())):
        top = list(zip(top_ids[i], top_vals[i])) if k else []
        out.append(TokenLogprob(t, v, top, int(ranks[i])))
    return out
