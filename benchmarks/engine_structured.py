"""`mooncake bench engine`, structured-output cases (issue 20): decode under a JSON schema
against the same decode unconstrained, batch 1 and batch 32, in one engine, interleaved
rep by rep (so load from other processes hits both alike).

The schema (an array of at least 64 records: a bounded string, an integer range, an enum
array) cannot end inside the decode, so both sides emit the same number of tokens; the
unconstrained side uses ignore_eos. Greedy on both sides. Rate: tokens emitted after every
request of the batch has its first token, over that span (prefill excluded), tok/s.

Rows: constrained_batch1, constrained_batch32 (ratio = constrained / unconstrained, target
>= 0.9); the result object also gets `constrained_batch1_ratio` and
`constrained_batch32_ratio`. Standalone: `python -m mooncaked.benchmarks.engine_structured`
(this case only, no transformers side).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import orjson

from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.structured import spec_for_json_schema
from mooncaked.engine.types import SamplingParams

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "maxItems": 3,
                 "items": {"enum": ["red", "green", "blue", "amber"]}}},
    "required": ["name", "age", "tags"]}}
PROMPT = [{"role": "user", "content": "List people as JSON records with name, age and tags."}]


def _decode_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                 tag: str) -> float:
    """Adds every prompt at once, steps until all finish; tok/s after the last first token."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    times: dict[str, list[float]] = {r: [] for r in rids}
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params, cache_salt=tag)
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times[o.request_id].extend([now] * len(o.new_token_ids))
    start = max(t[0] for t in times.values())
    end = max(t[-1] for t in times.values())
    n = sum(1 for t in times.values() for x in t if x > start)
    return n / (end - start)


def run_cases(engine: LLMEngine, reps: int = 3, decode_tokens: int = 64, batch: int = 32
              ) -> list[dict]:
    """The constrained-vs-unconstrained rows (see module doc), medians over `reps`.

    Args: engine: a loaded LLMEngine; decode_tokens: tokens per request (>= 8); batch:
        the larger batch size.
    """
    tok = engine.tokenizer
    base = tok.apply_chat_template(PROMPT)
    rng = np.random.default_rng(20)
    # different prompts per request (a distinct suffix), same length
    prompts = [base + rng.integers(100, 1000, 4).tolist() for _ in range(batch)]
    free = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    spec = spec_for_json_schema(SCHEMA)
    bound = SamplingParams(max_tokens=decode_tokens, temperature=0.0, structured=spec)
    n = [0]

    def rate(ps: list[list[int]], params: SamplingParams) -> float:
        n[0] += 1
        return _decode_rate(engine, ps, params, f"bench-structured-{n[0]}")

    for size in (1, batch):                 # warm-up: shapes, and the grammar's compile
        rate(prompts[:size], free)
        rate(prompts[:size], bound)
    rows = []
    for size in (1, batch):
        s: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
        for _ in range(reps):
            s["unconstrained"].append(rate(prompts[:size], free))
            s["constrained"].append(rate(prompts[:size], bound))
        ours, base_rate = statistics.median(s["constrained"]), statistics.median(s["unconstrained"])
        ratio = round(ours / base_rate, 3)
        rows.append({"case": f"constrained_batch{size}",
                     "unit": "tok/s", "ours": round(ours, 4), "baseline": round(base_rate, 4),
                     "ratio": ratio, "ratio_means": "constrained / unconstrained tok/s",
                     "baseline_name": "the same decode without a constraint (ignore_eos)",
                     "target": ">= 0.9", "meets_target": ratio >= 0.9, "batch": size,
                     "decode_tokens": decode_tokens, "samples": s})
    return rows


def add_to(result: dict, engine: LLMEngine, reps: int, decode_tokens: int) -> None:
    """The hook `mooncake bench engine` calls: appends the rows to result["results"] and
    sets result["constrained_batch1_ratio"] / ["constrained_batch32_ratio"]."""
    for r in run_cases(engine, reps=reps, decode_tokens=max(8, decode_tokens)):
        result["results"].append(r)
        result[f"{r['case']}_ratio"] = r["ratio"]


def main(argv: list[str]) -> None:
    """Standalone run: `python -m mooncaked.benchmarks.engine_structured [reps] [tokens]`."""
    from mooncaked.config import load_settings

    reps = int(argv[0]) if argv else 3
    tokens = int(argv[1]) if len(argv) > 1 else 64
    engine = LLMEngine(load_settings(None, {}))
    res: dict = {"benchmark": "engine_structured", "results": []}
    add_to(res, engine, reps, tokens)
    print(orjson.dumps(res).decode())


if __name__ == "__main__":
    main(sys.argv[1:])
