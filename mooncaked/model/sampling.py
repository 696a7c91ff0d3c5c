"""Next-token selection: penalties, temperature, top-k, top-p, min-p, seeded sampling.

Semantics follow vLLM's sampler: penalties first (repetition on prompt and
output tokens; presence and frequency on output tokens), then greedy argmax or
temperature scaling, top-k, top-p and min-p filtering and a multinomial draw
with a generator seeded from (request seed, output position), so a seeded request
samples the same tokens wherever its steps run (one engine, or a prefill node then
a decode node). Logprobs come from the raw model
distribution (log_softmax of the unmodified logits), like vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.engine.types import SamplingParams, TokenLogprob


@dataclass
class SamplingRow:
    """One sequence's inputs to sampling.

    token_ids: prompt + output so far (for the repetition penalty); num_prompt_tokens
    splits it. With params.seed set, the draw for output position p uses a generator
    seeded from (seed, p); without, torch's global generator.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def generator(self) -> torch.Generator | None:
        """A generator for this row's draw: seeded per (request seed, output position)."""
        seed = self.params.seed
        if seed is None:
            return None
        position = len(self.token_ids) - self.num_prompt_tokens
        return torch.Generator().manual_seed((seed * 1_000_003 + position) % (1 << 63))


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(row.token_ids) > row.num_prompt_tokens:
        out = torch.tensor(row.token_ids[row.num_prompt_tokens:], dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    p = row.params
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Drop tokens whose preceding mass already reaches top_p (keep at least one).
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=row.generator))


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
        tokens = [_sample_row(_apply_penalties(logits[i], r), r) for i, r in enumerate(rows)]
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
