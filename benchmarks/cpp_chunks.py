"""The CPP chunk-size trade-off, measured on one stage: `python -m mooncaked.benchmarks.cpp_chunks
[--tokens 4096] [--chunks 128,256,512,1024,2048] [--reps 2] [--layers 0:15]`.

One StageEngine (a stage's layers of the bundled model, fp32, one torch thread) in this
process runs a prompt of `--tokens` random tokens chunk by chunk at each chunk size, reps
interleaved; each chunk's compute is timed in thread CPU seconds (`time.thread_time`), so
the figures hold up when other processes share the machine (wall seconds are printed
beside them). From a stage's chunk times s_i the pipelined prefill of `--stages` equal
stages is predicted as conductor/cpp_cost.py does:

    total = sum_i s_i                       smaller chunks: more per-chunk overhead, smaller matmuls
    bubble = (stages - 1) * max_i s_i       the fill / drain: one (the largest: the last) chunk per other stage
    pipelined = total + bubble              hops and RPCs not included

Prints one JSON object: per chunk size the means over reps and every rep's figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson
import torch


def run(tokens: int, chunks: list[int], reps: int, layers: range, stages: int) -> dict:
    """The measurements (see the module doc)."""
    from mooncaked.engine.stage import StageEngine  # noqa: PLC0415 - heavy
    from mooncaked.model.weights import bundled_model_path  # noqa: PLC0415

    st = StageEngine(bundled_model_path(), layers, kv_cache_bytes=256 << 20, max_positions=tokens + 64,
                     num_threads=1)
    rng = random.Random(1)
    ids = torch.tensor([rng.randrange(100, 49000) for _ in range(tokens)])
    inputs = ids if st.is_first else torch.randn(tokens, st.hidden_size)
    st.run_chunk("warm", 0, inputs[:64])
    st.release("warm")
    reps_out: dict[int, list[dict]] = {c: [] for c in chunks}
    for rep in range(reps):
        for c in chunks:
            rid = f"r{c}-{rep}"
            cpu, wall = [], []
            for s in range(0, tokens, c):
                t0, w0 = time.thread_time(), time.perf_counter()
                st.run_chunk(rid, s, inputs[s:min(s + c, tokens)])
                cpu.append(time.thread_time() - t0)
                wall.append(time.perf_counter() - w0)
            st.release(rid)
            reps_out[c].append({"total_s": round(sum(cpu), 3), "first_s": round(cpu[0], 3),
                                "max_s": round(max(cpu), 3), "wall_total_s": round(sum(wall), 3)})
    results = []
    for c in chunks:
        rs = reps_out[c]
        total = statistics.fmean(r["total_s"] for r in rs)
        worst = statistics.fmean(r["max_s"] for r in rs)
        results.append({"chunk_tokens": c, "chunks": -(-tokens // c), "stage_total_s": round(total, 3),
                        "per_chunk_s": round(total / -(-tokens // c), 4), "largest_chunk_s": round(worst, 3),
                        "bubble_s": round((stages - 1) * worst, 3),
                        "pipelined_s": round(total + (stages - 1) * worst, 3), "reps": rs})
    return {"benchmark": "cpp_chunks", "tokens": tokens, "layers": [layers.start, layers.stop],
            "stages": stages, "clock": "thread CPU seconds", "results": results}


def main(argv: list[str] | None = None) -> dict:
    """Command line (see the module doc); prints and returns the result object."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunks", default="128,256,512,1024,2048")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--layers", default="0:15", help="the stage's layers, START:STOP")
    p.add_argument("--stages", type=int, default=2, help="equal stages the prediction assumes")
    a = p.parse_args(argv)
    lo, hi = (int(x) for x in a.layers.split(":"))
    res = run(a.tokens, [int(x) for x in a.chunks.split(",")], a.reps, range(lo, hi), a.stages)
    print(orjson.dumps(res).decode())
    return res


if __name__ == "__main__":
    main()
