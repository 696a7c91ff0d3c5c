"""A short profile of the engine at node start, so the conductor's cost model is
calibrated before the first request (issue 33).

A cluster model node runs it once, after the engine's warm-up (`ModelRunner.warm_up`) and
before the node registers, i.e. before /health turns 200. It serves a few synthetic
requests through the engine's own `step` (the same scheduler, pages, kernels and timing
as served requests), so its timed steps are exactly the (new tokens, cached tokens,
seconds) prefill steps and (batch size, context tokens, seconds) decode steps a node
reports while serving (`LLMEngine.prefill_steps` / `decode_steps`, NodeReport):

- prefill: requests of 32 to 512 new tokens, each alone, fresh and after a cached
  128-token prefix (the prefix is prefilled first: a real prefix-cache hit), one token
  each: `PREFILL_PLAN`, cheapest first (its first 7 requests and the prefix give 8 timed
  steps in about 830 prompt tokens);
- decode: batches of 1, 2, 4 and 8 requests of 16-token prompts, each generating
  `DECODE_STEPS_PER_BATCH` tokens after its first: `DECODE_BATCHES`, 12 timed decode steps.

The node publishes the result in its member record (`model.startup_profile`); the
conductor feeds those steps to its `CostModelRefitter` as it feeds served ones, and a
decode node to its own TBT check (cluster/admission.py). Both plans give at least
`conductor.admission_warmup` (default 8) steps of their kind, so the built-in default
model is calibrated from the first request on.

A complete profile is cached per machine and model (`cached_startup_profile`, in the load
cache's directory, model/load_cache.py): the key is the model file as it is now, the CPU
and its ISA level, torch's threads and version, the model and engine settings and the
plan, so a node that starts again on the same machine with the same settings reuses the
steps at once (the online refit corrects what has drifted since). Deleting the cache
directory's `startup-profile/` makes the next start measure again. A profile that got less
than MIN_CPU_SHARE of its threads' CPU time (StartupProfile.cpu_share: `mooncake up`
starts every node at once, and a node profiling while another loads or compiles measures
its steps slower than the machine is) is used for this start but not cached, so that a
passing contention is not kept as the machine's speed.

The profile is bounded by `engine.startup_profile_s` (0: skipped): before each request it
estimates the request's time from the seconds per token of the plan's previous (next
smaller) request and stops when
that would end past the budget, so it overruns only by the estimate's error. Then the
engine's prefix cache, scheduler counters and step records are reset: serving starts as
if the profile had not run (the pages it wrote are free again, their keys forgotten).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import TYPE_CHECKING

import torch

from mooncaked.kernels import cpu_isa
from mooncaked.log import get_logger
from mooncaked.model import load_cache

from .types import SamplingParams, StartupProfile

log = get_logger(__name__)

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

# (new tokens, cached prefix tokens) of each prefill request, in order; the 256-token
# prefix is prefilled once before the first request that needs it (a timed step too)
PREFILL_PLAN: tuple[tuple[int, int], ...] = ((32, 0), (32, 128), (64, 0), (64, 128),
                                             (128, 0), (128, 128), (256, 0), (256, 128),
                                             (512, 0))
PREFIX_TOKENS = 128
DECODE_BATCHES: tuple[int, ...] = (1, 2, 4, 8)
DECODE_PROMPT_TOKENS = 16
DECODE_STEPS_PER_BATCH = 3
KINDS = ("prefill", "decode")
# A profile that got less of the CPU than this is not cached (see the module doc).
MIN_CPU_SHARE = 0.7


def _run_to_end(engine: LLMEngine, requests: list[tuple[str, list[int], int]]) -> None:
    """Adds the (request id, prompt, max_tokens) requests and steps the engine until it is
    idle (greedy, ignoring EOS, so each generates exactly max_tokens)."""
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True))
    while engine.has_work():
        engine.step()


def run_startup_profile(engine: LLMEngine, budget_s: float,
                        kinds: tuple[str, ...] = KINDS) -> StartupProfile:
    """Runs the start-up profile (see the module doc) on an engine that serves nothing yet.

    Args:
        engine: a constructed LLMEngine with no request.
        budget_s: stop starting profile requests after this many seconds (0: do nothing).
        kinds: which plans to run: "prefill" (a prefill or coupled node), "decode" (a
            decode or coupled node).
    Returns: the StartupProfile (also kept as engine.startup_profile).
    Raises: ValueError when the engine has work or a kind is unknown.
    """
    if engine.has_work():
        raise ValueError("the start-up profile needs an idle engine")
    if not set(kinds) <= set(KINDS):
        raise ValueError(f"startup profile kinds must be among {KINDS}, got {kinds}")
    t0, cpu0 = time.monotonic(), time.process_time()
    rng = random.Random(0)
    vocab = engine.cfg.vocab_size
    limit = engine.max_model_len - 1        # a prompt plus its first generated token fits

    def tokens(n: int) -> list[int]:
        return [rng.randrange(min(1000, vocab - 1), vocab) for _ in range(n)]

    # Seconds per computed token of the plan's last request so far. The plans go from the
    # cheapest request up, so the last one is the nearest in size to the next: a small
    # request's fixed cost (a 32-token prefill: 0.17 s, 5 ms a token, against 2.8 ms a
    # token at 512 on a 2-core AMD EPYC) would double the estimate of a large one and stop
    # the profile long before its budget. Reset per plan: a decode token costs more than
    # a prefill token.
    per_token = 0.0

    def fits(n_tokens: int) -> bool:
        """Whether computing n_tokens more is predicted to end within the budget."""
        return time.monotonic() - t0 + per_token * n_tokens <= budget_s

    def run(requests: list[tuple[str, list[int], int]], n_tokens: int) -> None:
        """Runs requests that compute n_tokens tokens (prompt not cached, then generated)."""
        nonlocal per_token
        t = time.monotonic()
        _run_to_end(engine, requests)
        per_token = (time.monotonic() - t) / max(1, n_tokens)

    ran_all = budget_s > 0
    engine.prefill_steps.clear()
    engine.decode_steps.clear()
    if budget_s > 0 and "prefill" in kinds:
        prefix: list[int] | None = None
        for i, (new, cached) in enumerate(PREFILL_PLAN):
            if cached + new > limit:
                continue
            need = new + (PREFIX_TOKENS if cached and prefix is None else 0)
            if not fits(need):
                ran_all = False
                break
            if cached and prefix is None:
                prefix = tokens(PREFIX_TOKENS)
                run([("startup-profile-prefix", prefix, 1)], PREFIX_TOKENS)
            head = prefix[:cached] if cached else []
            run([(f"startup-profile-prefill-{i}", head + tokens(new), 1)], new)
    if budget_s > 0 and "decode" in kinds:
        per_token = 0.0
        for b in DECODE_BATCHES:
            if DECODE_PROMPT_TOKENS + DECODE_STEPS_PER_BATCH + 1 > limit:
                break
            n_tokens = b * (DECODE_PROMPT_TOKENS + DECODE_STEPS_PER_BATCH)
            if not fits(n_tokens):
                ran_all = False
                break
            run([(f"startup-profile-decode-{b}-{j}", tokens(DECODE_PROMPT_TOKENS),
                  DECODE_STEPS_PER_BATCH + 1) for j in range(b)], n_tokens)
    prefill = tuple(engine.prefill_steps) if "prefill" in kinds else ()
    decode = tuple(engine.decode_steps) if "decode" in kinds else ()
    engine.reset_after_profile()
    wall = time.monotonic() - t0
    share = 1.0      # nothing timed (budget 0): nothing to say about contention
    if (prefill or decode) and wall > 0:
        share = min(1.0, (time.process_time() - cpu0) / (wall * torch.get_num_threads()))
    profile = StartupProfile(wall, budget_s, ran_all, prefill, decode, cpu_share=share,
                             contended=share < MIN_CPU_SHARE)
    engine.startup_profile = profile
    return profile


def profile_cache_key(engine: LLMEngine, kinds: tuple[str, ...]) -> str:
    """The profile cache's key for `engine` on this machine: the model file (path, size,
    mtime), the CPU and ISA level, torch's version and threads, the model and engine
    settings (the profile's budget left out), the kinds and the plan. Raises OSError when
    the model file is gone."""
    es = dataclasses.replace(engine.settings.engine, startup_profile_s=0.0)
    plan = (PREFILL_PLAN, PREFIX_TOKENS, DECODE_BATCHES, DECODE_PROMPT_TOKENS,
            DECODE_STEPS_PER_BATCH)
    return load_cache.file_key(engine.model_path, cpu_isa.cpu_name(), cpu_isa.isa_level(),
                               torch.__version__, str(torch.get_num_threads()),
                               repr(engine.settings.model), repr(es), ",".join(kinds),
                               repr(plan))


def cached_startup_profile(engine: LLMEngine, budget_s: float,
                           kinds: tuple[str, ...] = KINDS) -> StartupProfile:
    """`run_startup_profile`, or the complete profile an earlier start of the same model
    with the same settings measured on this machine (then `cached` is True and nothing
    runs). A complete run that got at least MIN_CPU_SHARE of the CPU is stored for the
    next start; an incomplete one (the budget ended it) or a contended one is not. A cache
    that cannot be read or written is skipped, logged.
    Args and raises: as run_startup_profile."""
    if budget_s <= 0:
        return run_startup_profile(engine, budget_s, kinds)
    try:
        path = load_cache.entry("startup-profile", profile_cache_key(engine, kinds) + ".json")
    except OSError as e:
        log.warning("startup_profile_uncached", error=str(e))
        return run_startup_profile(engine, budget_s, kinds)
    try:
        cached = StartupProfile.from_json(json.loads(path.read_text()))
        if cached.complete:
            profile = dataclasses.replace(cached, budget_s=budget_s, cached=True)
            engine.startup_profile = profile
            return profile
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:      # damaged entry: measure again and replace it
        log.warning("startup_profile_cache_damaged", path=str(path), error=str(e))
    profile = run_startup_profile(engine, budget_s, kinds)
    if profile.complete and not profile.contended:
        load_cache.write_file(path, json.dumps(profile.to_json()).encode())
    elif profile.complete:
        log.warning("startup_profile_contended", cpu_share=round(profile.cpu_share, 3),
                    min_cpu_share=MIN_CPU_SHARE,
                    hint="other processes took the CPU while it ran: used now, not cached")
    return profile


__all__ = ["DECODE_BATCHES", "DECODE_PROMPT_TOKENS", "DECODE_STEPS_PER_BATCH", "KINDS",
           "MIN_CPU_SHARE", "PREFILL_PLAN", "PREFIX_TOKENS", "cached_startup_profile", "profile_cache_key",
           "run_startup_profile"]
