"""Batch-1 quantized GEMV: kernels/cpu_gemv.py's variants against torch's int4 kernel and
the NumPy reference, and against this machine's streaming bandwidth, one run.

Weights are GGUF Q4_1 blocks of random codes in the bundled model's layer shapes
(SmolLM2-135M: qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536), all 30
layers, 66 MB: more than the last-level cache, so each sweep reads them from DRAM as a
decode step does. Per sweep each side multiplies one activation row by every layer's four
matrices: ours (`cpu_gemv.gemv`, each variant this CPU runs, activations quantized inside;
`_kernel`: the jitted kernel alone on activations quantized beforehand, no Python per call),
torch's `_weight_int4pack_mm_for_cpu` with bf16 activations (what the per-op path uses;
`quant.Int4Linear`, its own packed copy of the same weights) and `gemv_reference` (NumPy,
fp32, the dequantized weights: dense, so 5x the bytes; on a sample of layers). The
bandwidth line is a NumPy sum over the same bytes (codes, d, m), the speed of reading them
at all. Medians of interleaved sweeps; GB/s counts the GGUF bytes (20 a block of 32).

    python -m mooncaked.benchmarks.gemv [--reps 9] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import orjson
import torch

from mooncaked.kernels import cpu_gemv, cpu_isa
from mooncaked.model import quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def _blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q4_1 blocks of random codes, fp16 d in [0, 0.02), m in (-0.1, 0]: uint8 [rows, cols / 32, 20]."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((rows, cols // 32)) * 0.02).astype(np.float16).view(np.uint8).reshape(
        rows, cols // 32, 2)
    blocks[..., 2:4] = (-rng.random((rows, cols // 32)) * 0.1).astype(np.float16).view(np.uint8).reshape(
        rows, cols // 32, 2)
    return blocks


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(reps: int = 9, threads: int = 1, layers: int = LAYERS) -> dict:
    """Times every side over `layers` layers of the four shapes; returns a dict of medians
    (seconds a sweep), GB/s over the GGUF bytes and ratios to our fastest variant."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    mats = []
    for _ in range(layers):
        for rows, cols in SHAPES.values():
            b = _blocks(rng, rows, cols)
            mats.append((cpu_gemv.GemvWeight.from_blocks(quant.Q4_1, b),
                         quant.Int4Linear([quant.QuantizedWeight(quant.Q4_1, b.reshape(rows, -1), (rows, cols))],
                                          torch.bfloat16, None)))
    xs = {cols: rng.standard_normal((1, cols)).astype(np.float32) for _, cols in SHAPES.values()}
    xb = {cols: torch.from_numpy(x).bfloat16() for cols, x in xs.items()}
    nbytes = sum(w.nbytes() for w, _ in mats)
    qx = {cols: cpu_gemv.quantize(x) for cols, x in xs.items()}
    out = {rows: np.empty((1, rows), np.float32) for rows, _ in SHAPES.values()}
    sides = {f"ours_{v}": (lambda v=v: [cpu_gemv.gemv(w, xs[w.shape[1]], v) for w, _ in mats])
             for v in cpu_gemv.VARIANTS[1:] if cpu_isa.has(v)}
    sides["torch_int4_bf16"] = lambda: [t(xb[w.shape[1]]) for w, t in mats]
    for v in cpu_gemv.VARIANTS[1:]:  # the kernel alone: activations quantized beforehand
        if cpu_isa.has(v):
            kern = cpu_gemv._gemv_vnni if v == "avx512_vnni" else cpu_gemv._gemv_avx2
            sides[f"ours_{v}_kernel"] = lambda kern=kern: [kern(w.codes, w.d, w.m, *qx[w.shape[1]], out[w.shape[0]],
                                                                True) for w, _ in mats]
    sides["numpy_sum_bytes"] = lambda: [(w.codes.view(np.int64).sum(), w.d.sum(dtype=np.int64),
                                         w.m.sum(dtype=np.int64)) for w, _ in mats]
    for fn in sides.values():  # compile, warm
        fn()
    times = {name: [] for name in sides}
    for _ in range(reps):
        for name, fn in sides.items():
            times[name].append(_median_s(fn, 1))
    sample = mats[:8]  # the reference dequantizes every call: two layers are enough
    ref_s = _median_s(lambda: [cpu_gemv.gemv_reference(w, xs[w.shape[1]]) for w, _ in sample], 3)
    med = {name: statistics.median(t) for name, t in times.items()}
    med["numpy_reference"] = ref_s * len(mats) / len(sample)
    best = min(v for k, v in med.items() if k.startswith("ours_") and not k.endswith("_kernel"))
    return {"benchmark": "gemv", "cpu": cpu_isa.cpu_name(), "isa": cpu_isa.isa_level(), "threads": threads,
            "layers": layers, "bytes": nbytes, "reps": reps, "statistic": "median",
            "results": {name: {"sweep_s": round(s, 6), "gb_s": round(nbytes / s / 1e9, 2),
                               "vs_ours": round(s / best, 2)} for name, s in med.items()}}


def main(argv: list[str] | None = None) -> None:
    """Command line: prints a table, or with --json the `run` result as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = run(a.reps, a.threads)
    if a.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
        return
    print(f"{out['cpu']} ({out['isa']}), {out['threads']} thread(s), {out['layers']} layers, "
          f"{out['bytes'] / 1e6:.1f} MB of GGUF blocks a sweep, medians of {out['reps']}")
    for name, r in out["results"].items():
        print(f"  {name:24s} {r['sweep_s'] * 1e3:8.2f} ms  {r['gb_s']:6.2f} GB/s  x{r['vs_ours']}")


if __name__ == "__main__":
    main()
