"""A synthetic Mooncake-format trace with its own reuse pattern: Poisson arrivals of chat
sessions over shared system prompts, each session a few turns whose prompt is the whole
conversation so far (`mooncake gen-trace`).

It exists so that scheduling results can be checked on a trace other than the one they
were tuned on (the conversation trace the Mooncake authors released). The reuse differs
from that trace's: many shared system prompts of a few blocks with Zipf popularity
(instead of one hot block), and multi-turn sessions whose later turns reuse the earlier
turns' prompt and answer (their blocks keep their keys across turns).

Model (all draws from one `random.Random(seed)`, so the same arguments give the same
trace byte for byte):

- sessions start as a Poisson process of `session_rate_rps` per second for `duration_s`;
- a session takes system prompt k of `system_prompts` with probability ~ 1 / (k + 1)^zipf_s;
  system prompt k is `system_blocks` blocks long (uniform in the given range), whole blocks,
  so its blocks are shared by every session that uses it;
- a session has a geometric number of turns of mean `mean_turns`; the next turn arrives
  30 ms a token of the answer (its decoding) plus an exponential think time of mean
  `think_s` after the previous one;
- a turn's new user input is log-normal (median `input_median`, sigma `input_sigma`
  tokens, at most `input_max`), its answer log-normal (median `output_median`, sigma 0.8,
  1 to 2,000 tokens);
- the prompt of turn t = system prompt + all earlier inputs and answers + the new input;
  its block keys: the system prompt's shared keys, then the session's own keys of every
  full block (the same key in every later turn), then a fresh key for the trailing
  partial block (as in the Mooncake traces, which key it too).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from .trace import TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class GenConfig:
    """Knobs of the generated trace (seconds, tokens). See the module doc.

    Raises (constructor): ValueError on a non-positive rate, duration or length, or an
    empty range.
    """

    seed: int = 0
    duration_s: float = 3600.0
    session_rate_rps: float = 1.0
    system_prompts: int = 200
    zipf_s: float = 1.0
    system_blocks: tuple[int, int] = (2, 12)
    mean_turns: float = 4.0
    think_s: float = 60.0
    input_median: float = 1200.0
    input_sigma: float = 1.3
    input_max: int = 60_000
    output_median: float = 250.0
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        lo, hi = self.system_blocks
        if not (self.duration_s > 0 and self.session_rate_rps > 0 and self.system_prompts >= 1
                and 0 <= lo <= hi and self.mean_turns >= 1 and self.think_s >= 0
                and self.input_median >= 1 and self.input_max >= 1 and self.output_median >= 1
                and self.block_tokens >= 1 and self.zipf_s >= 0 and self.input_sigma >= 0):
            raise ValueError(f"invalid trace generator settings: {self}")


def generate(cfg: GenConfig) -> list[dict]:
    """The trace as Mooncake-format records, sorted by timestamp.

    Returns: dicts with `timestamp` (ms after the first arrival, int), `input_length`,
    `output_length` (tokens) and `hash_ids` (block keys, ints), ready for one JSON line
    each. Deterministic: the same `cfg` gives the same list.
    """
    rng = random.Random(cfg.seed)
    bs = cfg.block_tokens
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.system_prompts)]
    sys_len = [rng.randint(*cfg.system_blocks) for _ in range(cfg.system_prompts)]
    next_key = 0
    sys_keys = []
    for n in sys_len:
        sys_keys.append(list(range(next_key, next_key + n)))
        next_key += n
    # (arrival s, tie-break, session state) of each session's next turn
    heap: list = []
    seq = 0
    t = rng.expovariate(cfg.session_rate_rps)
    while t < cfg.duration_s:
        k = rng.choices(range(cfg.system_prompts), weights)[0]
        turns = 1
        while rng.random() > 1.0 / cfg.mean_turns:
            turns += 1
        heap.append((t, seq, {"sys": k, "keys": list(sys_keys[k]), "len": sys_len[k] * bs,
                              "left": turns}))
        seq += 1
        t += rng.expovariate(cfg.session_rate_rps)
    heapq.heapify(heap)
    out = []
    while heap:
        t, _, s = heapq.heappop(heap)
        new = min(cfg.input_max, max(1, round(rng.lognormvariate(math.log(cfg.input_median),
                                                                 cfg.input_sigma))))
        answer = min(2000, max(1, round(rng.lognormvariate(math.log(cfg.output_median), 0.8))))
        n = s["len"] + new
        keys = s["keys"]
        while len(keys) < n // bs:            # the session's own full blocks keep their keys
            keys.append(next_key)
            next_key += 1
        ids = keys[:n // bs]
        if n % bs:
            ids = ids + [next_key]            # the trailing partial block: a fresh key
            next_key += 1
        out.append({"timestamp": t, "input_length": n, "output_length": answer,
                    "hash_ids": list(ids)})
        s["len"] = n + answer
        s["left"] -= 1
        if s["left"] > 0:
            heapq.heappush(heap, (t + answer * 0.03 + rng.expovariate(1.0 / cfg.think_s)
                                  if cfg.think_s > 0 else t, seq, s))
            seq += 1
    out.sort(key=lambda r: r["timestamp"])
    t0 = out[0]["timestamp"] if out else 0.0
    for r in out:
        r["timestamp"] = round((r["timestamp"] - t0) * 1000)
    return out


def iter_jsonl(records: list[dict]) -> Iterator[bytes]:
    """One JSON line (bytes, newline-terminated) per record, keys in the trace's order."""
    import orjson

    for r in records:
        yield orjson.dumps(r) + b"\n"


__all__ = ["GenConfig", "generate", "iter_jsonl"]
