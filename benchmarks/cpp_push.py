"""What a CPP stage's KV push leaves exposed after its last chunk, whole-stage push against
chunk-by-chunk push: `python -m mooncaked.benchmarks.cpp_push [--tokens 4096,7168]
[--chunk-tokens 512] [--reps 5]`.

One StageEngine (layers 15-29 of the bundled model, fp32, one torch thread) whose pages for
a prompt are filled with random values (the cost is copies and bytes, not compute) and two
transfer engines in this process (sender, and a receiver holding the decode node's
layer-major buffer [30 layers, blocks, 2, 16, kv_heads, head_dim]), talking TCP on
loopback. Timed, median of `--reps`:

- whole: what the last stage did after its last chunk before layer-wise push per chunk:
  gather all its blocks layer-major (read_kv + transpose + contiguous) and WRITE its whole
  layer range (one run);
- last_chunk: what it does now after its last chunk: gather the last chunk's blocks
  (read_kv_layer_major, one index_select per layer) and WRITE one run per layer (the
  earlier chunks' pushes ran during the compute).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
import torch


async def _run(tokens: list[int], chunk: int, reps: int) -> dict:
    from mooncaked.engine.stage import StageEngine, _StageSeq  # noqa: PLC0415 - heavy
    from mooncaked.model.weights import bundled_model_path  # noqa: PLC0415
    from mooncaked.transfer.batch import TransferOp, TransferRequest  # noqa: PLC0415
    from mooncaked.transfer.engine import TransferEngine  # noqa: PLC0415

    st = StageEngine(bundled_model_path(), range(15, 30), kv_cache_bytes=1 << 30,
                     max_positions=max(tokens) + 64, num_threads=1)
    st.kv_cache.normal_()
    cfg, bs, n_layers = st.cfg, st.block_size, len(st.layers)
    block_layer = 2 * bs * cfg.num_kv_heads * cfg.head_dim * st.dtype.itemsize
    results = []
    async with TransferEngine(node_id="push-send") as a, TransferEngine(node_id="push-recv") as b:
        for n in tokens:
            rid = f"push-{n}"
            seq = st.seqs.setdefault(rid, _StageSeq())
            st._ensure_pages(seq, n)
            seq.num_tokens = n
            nb = -(-n // bs)
            buf = torch.empty((cfg.num_layers, nb, 2, bs, cfg.num_kv_heads, cfg.head_dim), dtype=st.dtype)
            seg = a.add_peer_segment(b.register_segment(f"push-recv/{n}", buf))
            per_layer = nb * block_layer
            lo = (n - 1) // chunk * chunk // bs        # the last chunk's first block
            whole, last = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                kv = st.read_kv(rid).transpose(0, 1).contiguous()
                await a.write(seg, st.layers.start * per_layer, kv)
                whole.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                kv = st.read_kv_layer_major(rid, lo, nb)
                k = nb - lo
                await a.transfer([TransferRequest(TransferOp.WRITE, seg, (st.layers.start + j) * per_layer
                                                  + lo * block_layer, kv, j * k * block_layer, k * block_layer)
                                  for j in range(n_layers)])
                last.append(time.perf_counter() - t0)
            st.release(rid)
            b.unregister_segment(f"push-recv/{n}")
            results.append({"prompt_tokens": n, "whole_s": round(statistics.median(whole), 4),
                            "whole_bytes": n_layers * per_layer,
                            "last_chunk_s": round(statistics.median(last), 4),
                            "last_chunk_bytes": n_layers * (nb - lo) * block_layer,
                            "whole_reps_s": [round(x, 4) for x in whole],
                            "last_chunk_reps_s": [round(x, 4) for x in last]})
    return {"benchmark": "cpp_push", "stage_layers": [st.layers.start, st.layers.stop],
            "chunk_tokens": chunk, "reps": reps, "results": results}


def main(argv: list[str] | None = None) -> dict:
    """Command line (see the module doc); prints and returns the result object."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,7168")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    res = asyncio.run(_run([int(x) for x in a.tokens.split(",")], a.chunk_tokens, a.reps))
    print(orjson.dumps(res).decode())
    return res


if __name__ == "__main__":
    main()
