"""bf16 causal prefill attention: kernels/cpu_prefill.py against torch's SDPA, one run.

Both sides get the same paged batch (one sequence of N new tokens on pages in random
order, the bundled model's shape by default: 9 query heads, 3 KV heads, head_dim 64) and
the same torch thread count; the two are timed interleaved, and the medians, their
ratio (ours / SDPA, lower is better) and both sides' max error against the torch
reference in fp32 are printed.

    python -m mooncaked.benchmarks.prefill_attention [--tokens 500 1000 2000] [--reps 9]
        [--threads 1] [--json]

Raises SystemExit where the kernel does not run here (no AVX512-BF16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import orjson
import torch

from mooncaked.kernels import cpu_prefill, reference


def _batch(tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    g = torch.Generator().manual_seed(tokens)
    blocks = -(-tokens // block_size)
    k = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=g).bfloat16()
    table = torch.randperm(blocks + 2, generator=g)[:blocks].int()[None]
    q = (torch.randn(tokens, heads, head_dim, generator=g) * 2).bfloat16()
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    ctx = torch.tensor([tokens], dtype=torch.int32)
    return q, k, v, table, cu, ctx, head_dim ** -0.5


def run(tokens: list[int], reps: int = 9, threads: int = 1, heads: int = 9, kv_heads: int = 3,
        head_dim: int = 64) -> dict:
    """Times both sides per prompt length; returns {"results": [...]} (seconds, medians).

    Raises: SystemExit if cpu_prefill does not run on this CPU."""
    if not cpu_prefill.supports(torch.bfloat16, head_dim):
        raise SystemExit("cpu_prefill needs a CPU with AVX512-BF16 and head_dim % 16 == 0")
    torch.set_num_threads(threads)
    results = []
    for n in tokens:
        args = _batch(n, heads, kv_heads, head_dim)
        q, k, v, *rest = args
        oracle = reference.paged_prefill_attention(q.float(), k.float(), v.float(), *rest)
        sides = {"ours": cpu_prefill.paged_prefill_attention, "sdpa": reference.paged_prefill_attention}
        times = {name: [] for name in sides}
        errors = {name: (f(*args).float() - oracle).abs().max().item() for name, f in sides.items()}
        for _ in range(reps):
            for name, f in sides.items():
                t0 = time.perf_counter()
                f(*args)
                times[name].append(time.perf_counter() - t0)
        ours, sdpa = statistics.median(times["ours"]), statistics.median(times["sdpa"])
        results.append({"tokens": n, "ours_s": round(ours, 6), "sdpa_s": round(sdpa, 6),
                        "ratio": round(ours / sdpa, 3), "ours_max_err": round(errors["ours"], 5),
                        "sdpa_max_err": round(errors["sdpa"], 5)})
    return {"benchmark": "prefill_attention", "threads": threads, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "reps": reps, "statistic": "median", "results": results}


def main(argv: list[str] | None = None) -> None:
    """Command line: prints a table, or with --json the `run` result as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[500, 1000, 2000])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    out = run(a.tokens, a.reps, a.threads)
    if a.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
        return
    print(f"prefill attention, bf16, {out['threads']} thread(s), medians of {a.reps}")
    for r in out["results"]:
        print(f"  {r['tokens']:>5} tokens: ours {r['ours_s'] * 1e3:7.2f} ms  SDPA {r['sdpa_s'] * 1e3:7.2f} ms"
              f"  ratio {r['ratio']:.3f}  (max err vs fp32: ours {r['ours_max_err']:.4f},"
              f" SDPA {r['sdpa_max_err']:.4f})")


if __name__ == "__main__":
    main()
