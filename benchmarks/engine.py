"""`mooncake bench engine`: our LLMEngine against Hugging Face transformers' `generate`.

Both sides run in this one process, on the same bundled GGUF model, the same
weight dtype, the same prompts and the same torch thread count, driven
synchronously (no HTTP), interleaved rep by rep so that noise from other
processes on the machine hits both alike. Every case is warmed up first and
reports the median over `reps` repetitions. Decoding is greedy with EOS
ignored (ours: `ignore_eos`; transformers: `min_new_tokens`), so both sides
emit the same number of tokens.

Cases (issue 2):
  1. decode_batch1: tokens/s of decoding `decode_tokens` tokens after a short chat
     prompt, prefill excluded: (N - 1) / (t_last_token - t_first_token). TTFT is
     reported beside it. transformers' token times come from a streamer.
     Target: ours / transformers >= 2.5.
  2. concurrent_32: 32 requests of different prompt lengths. Ours: all added at
     once, continuous batching; transformers: one left-padded batch of the same
     32 prompts with an attention mask. Output tokens / wall time (prefill
     included). Target: ours / transformers >= 1.5.
  3. ttft_prefix_cached: TTFT of a 1,000-token prompt whose first 960 tokens
     (60 blocks of 16) were cached by an earlier request, against the same
     prompt cold (first token changed, so no block key matches). Target: warm /
     cold <= 0.2. Also ours cold against transformers' TTFT (`generate` of one
     token) on the same prompt: ttft_cold_vs_transformers (issue 30: target <= 0.8; issue 15's was <= 1.0). The
     row also holds the engine steps the cold prompt took (`prefill_steps`: 1 when the
     idle budget, engine.idle_prefill_tokens, covers it) and the same comparison at the
     other `ttft_cold_lengths` (default 500 and 2,000 tokens), interleaved in the same reps,
     and `paired_ratio_median`, the median of the reps' own ours / baseline (the two sides
     of a rep run back to back, so it follows load swings less than the ratio of medians).
  4. constrained_batch1, constrained_batch32 (issue 20, engine_structured.py): decode
     under a JSON schema against the same decode unconstrained, ours on both sides.
     Target: constrained / unconstrained >= 0.9.
  5. decode_batch1_vs_llamacpp (only when llama-cpp-python is importable: `pip install
     .[bench]`): case 1 against llama.cpp decoding the same GGUF file, the same prompt
     token ids, greedy, the same output length and thread count, in the same run.
     Target: ours / llama.cpp >= 1.0.
  6. decode_step_long_context (issue 15): the median decode step of `step_batch` (32)
     requests whose prompts are `step_long` (1,000) tokens, against the same batch with
     `step_short` (100) token prompts, ours on both sides (the step's attention must cost
     what the KV it reads costs). Target: long / short <= 2.0. It runs after the other
     cases; each length's prompts are prefilled once and come from the prefix cache in
     every rep (only the decode steps are timed).

`--dtype auto` (the default) runs what model.dtype = auto resolves to on this CPU, on both
sides; the object says which (`dtype`, `requested_dtype`) and which CPU and kernel variants
ours ran (`cpu`, `isa`, `decode_path`, `prefill_path`). bf16 on a CPU without native bf16
skips the cases that cannot end in bounded time there (`skipped_cases`; the object's
`skipped` lists them with the reason).

Baselines live in small `_<name>_load` / `_<name>_decode` helpers and each case adds rows
through `row(...)`: a new case or baseline is one more block of the same shape.

Ratios: throughput rows are ours / baseline (higher is better); TTFT rows are
ours / baseline too (lower is better); each row says so in `ratio_means`.
Every rep of ours uses a fresh `cache_salt`, so no rep reuses another's blocks (case 6
aside, as said).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import orjson
import torch

from mooncaked.config import load_settings
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.types import SamplingParams
from mooncaked.kernels import cpu_isa
from mooncaked.model.numerics import DTYPE_CHOICES, DTYPES
from mooncaked.model.weights import bundled_model_path

from . import hf_reference
from .engine_structured import run_cases as structured_cases

LABELS = {"decode_batch1": "decode, batch 1", "concurrent_32": "32 concurrent",
          "decode_batch1_vs_llamacpp": "decode, batch 1 vs llama.cpp",
          "ttft_prefix_cached": "TTFT warm / cold", "ttft_cold_vs_transformers": "TTFT cold vs HF",
          "decode_step_long_context": "decode step, long / short context"}
SHORT_PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
# `--quick`: every case at toy sizes (a smoke run of the whole pipeline, about half a minute
# on 2 cores, mostly loading the model twice); the figures say little about performance.
QUICK = {"decode_tokens": 8, "concurrent": 4, "concurrent_tokens": 4, "concurrent_max_prompt": 32,
         "ttft_prompt": 80, "ttft_cached": 64, "ttft_cold_lengths": (40,),
         "kv_cache_bytes": 64 * 1024 * 1024,
         "step_batch": 4, "step_short": 16, "step_long": 64, "step_tokens": 4}


class _Run:
    """Request ids and cache salts that never repeat within one benchmark run."""

    def __init__(self):
        self.n = 0

    def next(self, what: str) -> str:
        self.n += 1
        return f"{what}-{self.n}"


# -- ours


def _ours_generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, salt: str,
                   ids: _Run) -> tuple[float, list[list[float]]]:
    """Adds every prompt at once, steps until all finish.

    Returns (t0, per request the perf_counter() time of each output token), seconds.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [ids.next("req") for _ in prompts]
    times: dict[str, list[float]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params, cache_salt=salt)
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times[o.request_id].extend([now] * len(o.new_token_ids))
    return t0, [times[r] for r in rids]


def _decode_step_s(engine: LLMEngine, prompts: list[list[int]], steps: int, salt: str,
                   ids: _Run) -> float:
    """Median seconds of `steps` decode steps with every prompt running (timed only once
    each request has its first token, so no prefill chunk is in a timed step; no request
    can finish before the timed steps are over, they are aborted after them).
    Raises: RuntimeError when a request finished early (the batch shrank)."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    rids = [ids.next("req") for _ in prompts]
    started: set[str] = set()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params, cache_salt=salt)
    while len(started) < len(prompts):
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        if len(outs) != len(prompts) or any(o.finished for o in outs):
            raise RuntimeError(f"a timed step decoded {len(outs)} of {len(prompts)} requests")
    for rid in rids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return statistics.median(times)


def _count_steps(engine: LLMEngine):
    """Starts counting engine.step() calls; returns a function that stops and returns the count."""
    n = [0]
    step = engine.step

    def counted():
        n[0] += 1
        return step()

    engine.step = counted

    def stop() -> int:
        del engine.step  # the instance attribute goes: the class's step again
        return n[0]

    return stop


# -- transformers


def _hf_load(dtype: str):
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # the same weights transformers reads from the GGUF file, through the load cache's
    # checkpoint of them (hf_reference.py: 0.2 s instead of 25-80 s of GGUF parsing)
    model = hf_reference.load_model(bundled_model_path(), DTYPES[dtype])
    return model, transformers


def _hf_generate(model, prompts: list[list[int]], n: int, pad_id: int, streamer=None) -> float:
    """Greedy `generate` of exactly n tokens for a left-padded batch. Returns wall seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id, streamer=streamer)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + n, out.shape
    return dt


def _hf_streamer(transformers):
    class TokenTimes(transformers.generation.streamers.BaseStreamer):
        """Records when generate hands out each new token (its first put is the prompt)."""

        def __init__(self):
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value):
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self):
            pass

    return TokenTimes()


# -- llama.cpp (optional: llama-cpp-python, the [bench] extra)


def _llamacpp_load(threads: int):
    """The same GGUF file in llama.cpp, or None when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama  # noqa: PLC0415 - optional baseline
    except ImportError:
        return None
    return Llama(model_path=str(bundled_model_path()), n_ctx=2048, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def _llamacpp_decode(llm, prompt: list[int], n: int) -> list[float]:
    """Greedy decode of exactly n tokens after `prompt` (EOS not checked, like ignore_eos).
    Returns the perf_counter() time of each token. The KV state is reset first: otherwise
    llama-cpp-python's generate(reset=True) keeps the prefix shared with the previous call
    and the first token's time would not be a cold TTFT."""
    llm.reset()
    times: list[float] = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                          reset=True):
        times.append(time.perf_counter())
        if len(times) == n:
            break
    return times


# -- the cases


def _random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    # Ordinary (non-special) token ids; random text is as costly to run as real text.
    return rng.integers(100, vocab - 100, n).tolist()


def _decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def skipped_cases(dtype: str, device_type: str, isa: str, concurrent: int) -> dict[str, str]:
    """Cases left out of a run, case name -> the reason (in the JSON's `skipped`), so that the
    whole benchmark ends in bounded time (issue 30: under 15 minutes in every dtype).

    bf16 on a CPU without native bf16 (below cpu_isa "avx512_bf16"): torch emulates bf16
    matmuls and its int4 kernels there, ours and transformers' alike. Measured on an AMD EPYC
    (AVX2), one thread, against fp32: a 256-token prefill about 7x (ours) and 13x
    (transformers) slower, so the cases that prefill tens of thousands of tokens
    (32 x 1,000 for the decode-step case, 32 padded prompts, 500/2,000-token TTFTs) would
    run for over 24 minutes. What stays: decode at batch 1 and the 1,000-token TTFTs.
    """
    if dtype != "bfloat16" or device_type != "cpu" or cpu_isa.LEVELS.index(isa) >= \
            cpu_isa.LEVELS.index("avx512_bf16"):
        return {}
    why = (f"bfloat16 on a CPU without native bf16 ({isa}): torch emulates bf16, so this case's "
           f"prefill would not end in bounded time; --dtype auto or float32 runs it")
    return {c: why for c in (f"concurrent_{concurrent}", "ttft_cold_other_lengths",
                             "decode_step_long_context", "constrained")}


def run(dtype: str = "auto", reps: int = 3, decode_tokens: int = 64, concurrent: int = 32,
        concurrent_tokens: int = 32, concurrent_max_prompt: int = 128, ttft_prompt: int = 1000,
        ttft_cached: int = 960, ttft_cold_lengths: tuple[int, ...] = (500, 2000),
        kv_cache_bytes: int = 2048 * 1024 * 1024, threads: int = 0,
        step_batch: int = 32, step_short: int = 100, step_long: int = 1000,
        step_tokens: int = 16) -> dict:
    """Runs the three cases on both sides and returns the result object (see module doc).

    Args:
        dtype: model.dtype of our engine, "auto", "float32" or "bfloat16"; transformers runs
            the dtype it resolves to (the JSON's `dtype`; `requested_dtype` is this).
        reps: timed repetitions per case (medians are reported), after one warm-up.
        decode_tokens: tokens generated in case 1.
        concurrent, concurrent_tokens, concurrent_max_prompt: case 2's request count,
            output tokens per request, and longest prompt (prompt lengths spread evenly
            from 16 tokens up to it).
        ttft_prompt, ttft_cached: case 3's prompt length and cached prefix, tokens.
        ttft_cold_lengths: further cold prompt lengths (tokens) timed against transformers
            beside ttft_prompt (the row's `by_prompt_tokens`); () for none.
        kv_cache_bytes: our engine's KV page budget, bytes (case 6 holds step_batch x
            step_long tokens: 1.5 GB in fp32).
        step_batch, step_short, step_long, step_tokens: case 6's batch, its two prompt
            lengths (tokens) and the decode steps timed per rep.
        threads: torch intra-op threads for both sides; 0 keeps torch's default.
    Raises: ValueError for an unknown dtype; ModelLoadError if the bundled model is missing.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {dtype!r}")
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    settings = load_settings(None, {"model.dtype": dtype, "engine.kv_cache_bytes": kv_cache_bytes,
                                    "model.num_threads": threads})
    engine = LLMEngine(settings)
    requested, dtype = dtype, engine.numerics.dtype   # auto resolved (model/numerics.py): both sides
    hf, transformers = _hf_load(dtype)
    ids = _Run()
    vocab = engine.cfg.vocab_size
    pad_id = min(engine.tokenizer.eos_token_ids)
    rng = np.random.default_rng(0)
    skipped = skipped_cases(dtype, engine.model.device.type, engine.kernel_paths.isa, concurrent)
    if "ttft_cold_other_lengths" in skipped:
        ttft_cold_lengths = ()

    short = engine.tokenizer.apply_chat_template(SHORT_PROMPT)
    lengths = np.linspace(16, concurrent_max_prompt, concurrent).round().astype(int).tolist()
    rng.shuffle(lengths)
    batch = [_random_prompt(rng, n, vocab) for n in lengths]
    long_prompt = _random_prompt(rng, ttft_prompt, vocab)
    cold_more = {n: _random_prompt(rng, n, vocab) for n in ttft_cold_lengths}
    step_prompts = {n: [_random_prompt(rng, n, vocab) for _ in range(step_batch)]
                    for n in (step_short, step_long)}

    # Warm-up: every kernel shape family once on both sides (decode, short and long prefill,
    # batched decode, cached-prefix prefill).
    warm = min(32, decode_tokens)
    _ours_generate(engine, [short], warm, ids.next("salt"), ids)
    if f"concurrent_{concurrent}" not in skipped:
        _ours_generate(engine, batch, 2, ids.next("salt"), ids)
        _hf_generate(hf, batch, 2, pad_id)
    salt = ids.next("salt")
    _ours_generate(engine, [long_prompt[:ttft_cached]], 1, salt, ids)
    _ours_generate(engine, [long_prompt], 1, salt, ids)
    _hf_generate(hf, [short], warm, pad_id)
    _hf_generate(hf, [long_prompt], 1, pad_id)
    for p in cold_more.values():
        _ours_generate(engine, [p], 1, ids.next("salt"), ids)
        _hf_generate(hf, [p], 1, pad_id)
    llm = _llamacpp_load(torch.get_num_threads())
    if llm is not None:
        _llamacpp_decode(llm, short, warm)

    c1 = {"ours_tps": [], "ours_ttft": [], "hf_tps": [], "hf_ttft": []}
    c2 = {"ours": [], "hf": []}
    c3 = {"warm": [], "cold": [], "hf": [], "cold_steps": []}
    c3_more = {n: {"ours": [], "hf": []} for n in cold_more}
    c4 = {"llamacpp_tps": [], "llamacpp_ttft": []}
    c6 = {"short": [], "long": []}
    for _ in range(reps):
        # 1. decode at batch 1
        t0, (times,) = _ours_generate(engine, [short], decode_tokens, ids.next("salt"), ids)
        assert len(times) == decode_tokens
        c1["ours_tps"].append(_decode_rate(times))
        c1["ours_ttft"].append(times[0] - t0)
        st = _hf_streamer(transformers)
        t0 = time.perf_counter()
        _hf_generate(hf, [short], decode_tokens, pad_id, streamer=st)
        assert len(st.times) == decode_tokens
        c1["hf_tps"].append(_decode_rate(st.times))
        c1["hf_ttft"].append(st.times[0] - t0)
        if llm is not None:
            t0 = time.perf_counter()
            times = _llamacpp_decode(llm, short, decode_tokens)
            assert len(times) == decode_tokens
            c4["llamacpp_tps"].append(_decode_rate(times))
            c4["llamacpp_ttft"].append(times[0] - t0)

        # 2. concurrent requests, continuous batching vs one padded batch
        if f"concurrent_{concurrent}" not in skipped:
            t0, times = _ours_generate(engine, batch, concurrent_tokens, ids.next("salt"), ids)
            wall = max(t[-1] for t in times) - t0
            assert all(len(t) == concurrent_tokens for t in times)
            c2["ours"].append(concurrent * concurrent_tokens / wall)
            c2["hf"].append(concurrent * concurrent_tokens / _hf_generate(hf, batch, concurrent_tokens,
                                                                          pad_id))

        # 3. TTFT: prefix cached vs cold (a different first token changes every block key)
        salt = ids.next("salt")
        _ours_generate(engine, [long_prompt[:ttft_cached]], 1, salt, ids)
        hits0 = engine.stats().prefix_hit_tokens_total
        t0, (times,) = _ours_generate(engine, [long_prompt], 1, salt, ids)
        hit = engine.stats().prefix_hit_tokens_total - hits0
        assert hit == ttft_cached, f"expected {ttft_cached} cached tokens, got {hit}"
        c3["warm"].append(times[0] - t0)
        cold_prompt = [long_prompt[0] + 1] + long_prompt[1:]
        hits0 = engine.stats().prefix_hit_tokens_total
        steps = _count_steps(engine)
        t0, (times,) = _ours_generate(engine, [cold_prompt], 1, salt, ids)
        c3["cold_steps"].append(steps())
        assert engine.stats().prefix_hit_tokens_total == hits0, "the cold prompt hit the prefix cache"
        c3["cold"].append(times[0] - t0)
        c3["hf"].append(_hf_generate(hf, [long_prompt], 1, pad_id))
        for n, p in cold_more.items():
            t0, (times,) = _ours_generate(engine, [p], 1, ids.next("salt"), ids)
            c3_more[n]["ours"].append(times[0] - t0)
            c3_more[n]["hf"].append(_hf_generate(hf, [p], 1, pad_id))

    # 6. decode step time, long against short context (same batch size), after the other
    # cases: each length's prompts are prefilled once, in an untimed first pass, and hit the
    # prefix cache in every rep (one salt per length; the two sets fit the KV pages together).
    # Only the timed decode steps matter here, and prefilling 32 x 1,000 tokens afresh each
    # rep was a third of the whole benchmark's time.
    step_salts = {n: ids.next("salt") for n in (step_short, step_long)}
    step_hits = 0
    if "decode_step_long_context" not in skipped:
        hits0 = engine.stats().prefix_hit_tokens_total
        for n in (step_short, step_long):
            _decode_step_s(engine, step_prompts[n], 2, step_salts[n], ids)
        hits1 = engine.stats().prefix_hit_tokens_total
        for _ in range(reps):
            for n in (step_short, step_long):
                c6["short" if n == step_short else "long"].append(
                    _decode_step_s(engine, step_prompts[n], step_tokens, step_salts[n], ids))
        step_hits = (engine.stats().prefix_hit_tokens_total - hits1) // reps
        # (a rep whose prompts were evicted, with many reps in small KV pages, prefills them
        # again: slower, the timed steps the same; prefix_hit_tokens_per_rep shows it)
        assert hits1 == hits0, "the first pass of case 6 hit the prefix cache"

    med = statistics.median

    def row(case, unit, ours, base, baseline, target, means, **extra):
        r = {"case": case, "unit": unit, "ours": round(ours, 4), "baseline": round(base, 4),
             "ratio": round(ours / base, 3), "ratio_means": means, "baseline_name": baseline,
             "target": target}
        r["meets_target"] = None  # no target set by the issue
        if target is not None:
            op, val = target.split()
            r["meets_target"] = r["ratio"] >= float(val) if op == ">=" else r["ratio"] <= float(val)
        return r | extra

    results = [r for r in [
        row("decode_batch1", "tok/s", med(c1["ours_tps"]), med(c1["hf_tps"]),
            "transformers generate (greedy, batch 1)", ">= 2.5", "ours / baseline (speedup)",
            decode_tokens=decode_tokens, prompt_tokens=len(short),
            ours_ttft_s=round(med(c1["ours_ttft"]), 4), baseline_ttft_s=round(med(c1["hf_ttft"]), 4)),
        c2["ours"] and row(f"concurrent_{concurrent}", "tok/s", med(c2["ours"]), med(c2["hf"]),
            "transformers generate on one left-padded batch", ">= 1.5", "ours / baseline (speedup)",
            requests=concurrent, output_tokens_each=concurrent_tokens,
            prompt_tokens_min=min(lengths), prompt_tokens_max=max(lengths),
            prompt_tokens_total=sum(lengths)),
        row("ttft_prefix_cached", "s", med(c3["warm"]), med(c3["cold"]),
            "ours, cold (same length, first token changed: no cached prefix)", "<= 0.2",
            "warm TTFT / cold TTFT",
            prompt_tokens=ttft_prompt, cached_tokens=ttft_cached),
        row("ttft_cold_vs_transformers", "s", med(c3["cold"]), med(c3["hf"]),
            "transformers generate of 1 token (no prefix cache)", "<= 0.8",
            "ours TTFT / baseline TTFT (lower is better)", prompt_tokens=ttft_prompt,
            paired_ratio_median=round(med([o / h for o, h in zip(c3["cold"], c3["hf"])]), 3),
            prefill_steps=max(c3["cold_steps"]),
            max_num_batched_tokens=settings.engine.max_num_batched_tokens,
            idle_prefill_tokens=settings.engine.idle_prefill_tokens,
            by_prompt_tokens={str(n): {"ours": round(med(v["ours"]), 4), "baseline": round(med(v["hf"]), 4),
                                       "ratio": round(med(v["ours"]) / med(v["hf"]), 3),
                                       "paired_ratio_median": round(med([o / h for o, h in zip(
                                           v["ours"], v["hf"])]), 3)}
                              for n, v in c3_more.items()}),
        c6["long"] and row("decode_step_long_context", "s", med(c6["long"]), med(c6["short"]),
            f"ours, the same {step_batch} requests with {step_short}-token prompts", "<= 2.0",
            "long-context step / short-context step", requests=step_batch,
            prompt_tokens_long=step_long, prompt_tokens_short=step_short,
            steps_timed=step_tokens, prefix_hit_tokens_per_rep=step_hits),
    ] if r]
    if llm is not None:
        results.append(row(
            "decode_batch1_vs_llamacpp", "tok/s", med(c1["ours_tps"]), med(c4["llamacpp_tps"]),
            f"llama.cpp (llama-cpp-python {_llamacpp_version()}, same GGUF, greedy, batch 1)",
            ">= 1.0", "ours / baseline (speedup)", decode_tokens=decode_tokens,
            prompt_tokens=len(short), baseline_ttft_s=round(med(c4["llamacpp_ttft"]), 4)))
    # structured outputs (issue 20): JSON-schema decode vs the same decode unconstrained
    if "constrained" not in skipped:
        results += structured_cases(engine, reps=reps, decode_tokens=decode_tokens, batch=concurrent)
    return {
        **{f"{r['case']}_ratio": r["ratio"] for r in results if r["case"].startswith("constrained")},
        "benchmark": "engine", "dtype": dtype, "requested_dtype": requested,
        # the CPU and the kernel variants our side ran (engine/kernel_paths.py)
        **{k: v for k, v in engine.kernel_paths.to_json().items() if k != "decode_why"},
        "skipped": [{"case": c, "reason": why} for c, why in skipped.items()],
        "model": bundled_model_path().name, "reps": reps,
        "statistic": "median", "torch_threads": torch.get_num_threads(),
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "engine": {"block_size": settings.engine.block_size, "kv_cache_bytes": kv_cache_bytes,
                   "max_num_batched_tokens": settings.engine.max_num_batched_tokens,
                   "idle_prefill_tokens": settings.engine.idle_prefill_tokens,
                   "max_num_seqs": settings.engine.max_num_seqs},
        "loadavg_1m_before": round(load_before[0], 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(), "wall_s": round(time.perf_counter() - t_start, 1),
        "results": results,
        "weight_format": settings.model.weight_format,
        # decode steps of up to this many sequences run the fused step (kernels/cpu_fused_decode.py);
        # fused_decode says why not when it is off for this model / machine
        "fused_decode_max_batch": engine.model.fused_decode_max_batch if engine.model.fused is not None else 0,
        "fused_decode": engine.model.fused_decode_reason or "on",
        "llamacpp": llm is not None,
        "samples": {"decode_batch1": c1, f"concurrent_{concurrent}": c2, "ttft": c3,
                    "ttft_cold_by_prompt_tokens": {str(n): v for n, v in c3_more.items()},
                    "decode_batch1_vs_llamacpp": c4, "decode_step_long_context": c6},
    }


def _llamacpp_version() -> str:
    import llama_cpp  # noqa: PLC0415

    return getattr(llama_cpp, "__version__", "?")


def main(json_out: bool = False, dtype: str = "auto", **kw) -> dict:
    """Runs the benchmark and prints a rich table (or one JSON object with `json_out`)."""
    res = run(dtype=dtype, **kw)
    if json_out:
        print(orjson.dumps(res).decode())
        return res
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"Engine vs transformers: {res['model']}, {res['dtype']} both sides, "
                    f"{res['torch_threads']} torch threads, median of {res['reps']}, "
                    f"load avg {res['loadavg_1m_before']} -> {res['loadavg_1m_after']}")
    for c in ("case", "unit", "ours", "baseline", "ratio", "target", ""):
        t.add_column(c, justify="right" if c in ("ours", "baseline", "ratio") else "left", no_wrap=True)
    for i, r in enumerate(res["results"], 1):
        verdict = {True: "[green]ok[/]", False: "[red]missed[/]", None: ""}[r["meets_target"]]
        t.add_row(f"[{i}] {LABELS.get(r['case'], r['case'])}", r["unit"], f"{r['ours']:.4g}",
                  f"{r['baseline']:.4g}", f"{r['ratio']:.3g}", r["target"] or "-", verdict)
    con = Console()
    con.print(t)
    for i, r in enumerate(res["results"], 1):
        con.print(f"[{i}] baseline: {r['baseline_name']}; ratio = {r['ratio_means']}")
    for sk in res["skipped"]:
        con.print(f"skipped {sk['case']}: {sk['reason']}")
    d = res["results"][0]
    con.print(f"batch-1 TTFT ({d['prompt_tokens']}-token prompt): ours {d['ours_ttft_s'] * 1e3:.1f} ms, "
              f"transformers {d['baseline_ttft_s'] * 1e3:.1f} ms; whole run {res['wall_s']} s")
    return res
