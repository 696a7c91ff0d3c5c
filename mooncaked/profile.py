"""`mooncaked profile`: fit the conductor's cost models on this hardware (Mooncake paper,
section 4: prefill time by polynomial regression on prompt and prefix-hit length).

Measures, with the node's own engine and transfer engine:
- prefill: time from admission to the first token of prompts of `new` fresh tokens
  after a cached prefix of `cached` tokens (the prefix is prefilled first, so it
  is a real device-cache hit), for a small grid of both;
- decode: step times of batches of b requests holding c context tokens each;
- transfer: READ bandwidth and latency between two transfer engines over loopback
  TCP (the path KV takes between nodes on this host).
Then `fit_cost_model` fits the polynomials and the result is saved where the
conductor looks for it (`conductor.cost_model`, else <state dir>/cost_model.json).
"""

from __future__ import annotations

import asyncio
import dataclasses
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mooncaked.conductor.cost_model import CostModel, fit_cost_model
from mooncaked.conductor.cost_store import cost_model_path
from mooncaked.config import Settings, TransferSettings
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.types import SamplingParams
from mooncaked.log import get_logger
from mooncaked.transfer import TransferEngine

log = get_logger(__name__)


@dataclass
class ProfileGrid:
    """What to measure: prefill (new, cached) token counts, decode batch sizes and context
    lengths per request, repeats per point (the median is kept), transfer sizes (bytes)."""
    prefill_new: tuple[int, ...] = (16, 64, 128, 256, 512)
    prefill_cached: tuple[int, ...] = (0, 128, 512)
    decode_batch: tuple[int, ...] = (1, 4, 8)
    decode_context: tuple[int, ...] = (32, 256)
    decode_steps: int = 6
    repeats: int = 2
    transfer_bytes: int = 64 * 1024 * 1024
    samples: dict = field(default_factory=dict)

    @classmethod
    def quick(cls) -> "ProfileGrid":
        """A small grid (about a quarter of the time) for slow machines and tests."""
        return cls(prefill_new=(16, 64, 256), prefill_cached=(0, 128), decode_batch=(1, 4),
                   decode_context=(32, 128), decode_steps=4, repeats=1,
                   transfer_bytes=16 * 1024 * 1024)

    @classmethod
    def tiny(cls) -> "ProfileGrid":
        """The smallest grid that still gives every fitted term a sample (6 prefill points
        for 5 prefill terms, 8 decode steps for 3 decode terms, prompts of at most 96
        tokens, a 1 MiB transfer): seconds after the model loads, for smoke tests. The fit
        is as noisy as its few short samples; not for a cluster's real cost model."""
        return cls(prefill_new=(16, 32, 64), prefill_cached=(0, 32), decode_batch=(1, 2),
                   decode_context=(16, 32), decode_steps=2, repeats=1,
                   transfer_bytes=1024 * 1024)


def _run(engine, rid: str, prompt: list[int], max_tokens: int = 1):
    """Runs one request to completion on a synchronous LLMEngine; returns (seconds, last output)."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    last = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                last = out
    return time.perf_counter() - t0, last


def measure_prefill(engine, grid: ProfileGrid, rng: random.Random) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, seconds) samples; cached prefixes are whole blocks."""
    vocab = engine.cfg.vocab_size
    bs = engine.block_size
    out = []
    n = 0
    for cached in grid.prefill_cached:
        cached -= cached % bs
        for new in grid.prefill_new:
            if cached + new >= engine.max_model_len:
                continue
            times, hits = [], []
            for _ in range(grid.repeats):
                n += 1
                prefix = [rng.randrange(1000, vocab) for _ in range(cached)]
                if cached:
                    _run(engine, f"warm-{n}", prefix)            # puts the prefix in the cache
                prompt = prefix + [rng.randrange(1000, vocab) for _ in range(new)]
                s, last = _run(engine, f"prefill-{n}", prompt)
                times.append(s)
                hits.append(last.num_cached_tokens if last is not None else 0)
            hit = int(statistics.median(hits))
            out.append((cached + new - hit, hit, statistics.median(times)))
            log.info("profile_prefill", new=cached + new - hit, cached=hit, seconds=out[-1][2])
    return out


def measure_decode(engine, grid: ProfileGrid, rng: random.Random) -> list[tuple[int, int, float]]:
    """(batch size, context tokens of the batch, seconds per step) samples."""
    vocab = engine.cfg.vocab_size
    out = []
    for ctx in grid.decode_context:
        for b in grid.decode_batch:
            for i in range(b):
                engine.add_request(f"dec-{ctx}-{b}-{i}", [rng.randrange(1000, vocab)
                                                         for _ in range(ctx)],
                                   SamplingParams(max_tokens=grid.decode_steps + 1,
                                                  temperature=0.0, ignore_eos=True))
            steps = []
            while engine.has_work():
                engine.step()
                st = engine.last_step
                if st.num_prefill_tokens == 0 and st.num_decode_seqs == b:
                    steps.append((st.context_tokens, st.seconds))
            for c, s in steps:
                out.append((b, c, s))
            if steps:
                log.info("profile_decode", batch=b, context_tokens=steps[0][0],
                         seconds=statistics.median(s for _, s in steps))
    return out


async def measure_transfer(settings: TransferSettings, nbytes: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of READs between two transfer engines on loopback."""
    s = dataclasses.replace(settings, port=0)
    a, b = TransferEngine(s, node_id="profile-a"), TransferEngine(s, node_id="profile-b")
    await a.start()
    await b.start()
    try:
        src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        name = b.add_peer_segment(a.register_segment("profile-a/buf", src))
        dst = np.empty(nbytes, dtype=np.uint8)
        small = np.empty(4096, dtype=np.uint8)
        await b.read(name, 0, dst)                  # warm up connections
        lat = []
        for _ in range(20):
            t0 = time.perf_counter()
            await b.read(name, 0, small)
            lat.append(time.perf_counter() - t0)
        bw = []
        for _ in range(3):
            t0 = time.perf_counter()
            await b.read(name, 0, dst)
            bw.append(nbytes / (time.perf_counter() - t0))
        if not np.array_equal(src, dst):
            raise RuntimeError("transfer check failed: bytes read differ from the source")
        return statistics.median(bw), statistics.median(lat)
    finally:
        await b.close()
        await a.close()


def run_profile(settings: Settings, grid: ProfileGrid | None = None,
                out: str | Path | None = None) -> tuple[CostModel, Path]:
    """Measures and fits the cost model of this node's model on this hardware and saves it.

    Args:
        settings: the node's settings (model, engine, transfer).
        grid: what to measure (default ProfileGrid()).
        out: where to save; default `cost_model_path(settings)`.
    Returns: (the fitted model, the path written).
    Raises: ModelLoadError, ValueError (too few samples), OSError (cannot write).
    """
    grid = grid or ProfileGrid()
    rng = random.Random(0)
    t0 = time.monotonic()
    engine = LLMEngine(settings)
    prefill = measure_prefill(engine, grid, rng)
    decode = measure_decode(engine, grid, rng)
    bw, lat = asyncio.run(measure_transfer(settings.transfer, grid.transfer_bytes))
    name = (f"{engine.model_name} ({engine.numerics.dtype}, {settings.model.device}) on "
            f"{platform.node()}")
    model = fit_cost_model(prefill, decode, bw, engine.block_bytes // engine.block_size,
                           latency_s=lat, name=name)
    model.meta.update({"profiled_at": time.time(), "profile_s": round(time.monotonic() - t0, 1),
                       "block_size": engine.block_size, "transfer_bytes": grid.transfer_bytes,
                       "prefill_samples": prefill, "decode_samples": decode[:64]})
    path = Path(out) if out else cost_model_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    log.info("profile_saved", path=str(path), seconds=round(time.monotonic() - t0, 1),
             bandwidth_bytes_per_s=bw, latency_s=lat)
    return model, path


__all__ = ["ProfileGrid", "measure_decode", "measure_prefill", "measure_transfer", "run_profile"]
