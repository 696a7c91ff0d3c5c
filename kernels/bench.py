"""Benchmark of the Triton paged-attention kernels against torch SDPA (and FlashInfer).

    python -m mooncaked.kernels.bench [--json]      (or: mooncake bench kernels [--json])

On one CUDA GPU, in one run:
  * device copy bandwidth: a large device-to-device copy, (bytes read + bytes written) / time;
  * decode attention at batch 1..64 and context 1k..32k: our paged kernel, torch SDPA over
    KV gathered from the pages (gather included: what a paged engine would have to do),
    SDPA over KV already contiguous (gather excluded: the best SDPA can do), and
    FlashInfer's paged decode when importable. Achieved bandwidth = bytes of K, V and Q
    read / time; its ratio to the copy bandwidth is the issue's target (>= 70% at >= 8k);
  * prefill attention (causal, with and without a cached prefix) in TFLOP/s against SDPA
    over contiguous KV (and FlashInfer's paged prefill when importable);
  * a decode tile sweep (tile tokens / num_warps / num_stages) at a few shapes, CUDA graph
    times, to choose the built-in decode tile on a new GPU;
  * block gather (pages -> contiguous buffer) against torch indexing.
Times are medians over a few iterations, measured with CUDA events, with the L2 cache
flushed before each. Decode is timed twice: eager (each call launched from Python, so
at small batch the host's launch work shows) and as a CUDA-graph replay of the same call
(the kernels alone, as a serving engine's decode step runs them, e.g. vLLM's); the ratios
and the summary use the graph times, for SDPA+gather as well, and the eager times stay in
the table. Each result row also carries the largest |ours - SDPA| difference,
a sanity check. Shapes default to a Llama-3-8B layer (32 query heads, 8 KV heads,
head_dim 128, bf16, 16-token blocks). The run stops adding rows after a time budget so
it finishes within 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mooncaked.utils import cdiv

from . import reference

DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CONTEXTS = (1024, 4096, 8192, 16384, 32768)
# (batch, new tokens, cached tokens) per sequence
PREFILL_CASES = ((1, 4096, 0), (1, 8192, 0), (4, 2048, 2048), (8, 512, 3584), (16, 1024, 0))
# Decode tile sweep (tile tokens, num_warps, num_stages) at (batch, context); the first is built in.
SWEEP_TILES = ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2), (128, 8, 3))
DECODE_SWEEP = ((1, 32768), (4, 8192), (16, 8192))
BUDGET_S = 200.0  # seconds; the rows measured so far take well under a minute on an H200


@dataclass
class Shape:
    """Model shape the benchmark runs (one attention layer)."""
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


class Timer:
    """Median time of a callable in seconds: CUDA events with an L2 flush before each run, or
    perf_counter on a CPU device (only for smoke tests of this module)."""

    def __init__(self, device: torch.device, iters: int = 10, warmup: int = 2):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.cuda = device.type == "cuda"
        # Larger than any L2 (H100/H200: 50 MB), so each run starts cold as in a real step.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def graph(self, fn: Callable[[], object]) -> float:
        """Median time of replaying `fn` captured in a CUDA graph (launch overhead excluded).

        `fn` runs twice on a side stream first (compiles, allocator warm-up), as torch's
        CUDA-graph docs prescribe. Raises: RuntimeError without CUDA, or what capture raises.
        """
        if not self.cuda:
            raise RuntimeError("CUDA graphs need a CUDA device")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return self(graph.replay)
        finally:
            del graph


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type == "cuda":
        nbytes = min(nbytes, torch.cuda.mem_get_info(device)[0] // 4)
    else:  # smoke tests only: keep host memory use small
        nbytes = min(nbytes, 16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * nbytes / t


def _paged_pool(batch: int, lengths: list[int], shape: Shape, device: torch.device, seed: int = 0):
    """A one-layer pool in the engine's layout with each sequence's blocks scattered through it.

    Returns (kv_cache [blocks, 1, 2, bs, H_kv, D], k view, v view, block_tables int32 [batch, width]).
    """
    bs = shape.block_size
    need = [cdiv(n, bs) for n in lengths]
    num_blocks = sum(need)
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(num_blocks, 1, 2, bs, shape.num_kv_heads, shape.head_dim, generator=gen,
                     device=device, dtype=shape.dtype)
    perm = torch.randperm(num_blocks, device=device, generator=gen).int()
    table = torch.zeros(batch, max(need), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n]
        used += n
    return kv, kv[:, 0, 0], kv[:, 0, 1], table


def _gathered(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, H_kv, length, D] view of every sequence's first `length` tokens (equal lengths)."""
    pages = cache[table.long()]  # [B, n, bs, H, D]
    return pages.flatten(1, 2)[:, :length].transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw) -> torch.Tensor:
    """SDPA with grouped KV heads (enable_gqa where this torch has it, else expanded KV)."""
    if k.shape[1] != q.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kw)
        except (TypeError, RuntimeError):
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)


def _flashinfer():
    try:
        import flashinfer  # noqa: PLC0415
        return flashinfer
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def _graph_time(timer: Timer, fn: Callable[[], object], row: dict, name: str) -> float:
    """CUDA-graph replay time of `fn`; its eager time (row[name + "_eager_s"]) when capture
    fails or there is no GPU, with the reason in row[name + "_graph_error"]."""
    if not timer.cuda:
        return row[f"{name}_eager_s"]
    try:
        return timer.graph(fn)
    except Exception as e:  # noqa: BLE001 - a capture failure must not lose the row
        row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.synchronize()
        return row[f"{name}_eager_s"]


def bench_decode(ops, batch: int, context: int, shape: Shape, device: torch.device, timer: Timer,
                 copy_bps: float) -> dict:
    """One decode row: times (s), achieved bandwidths (bytes/s) and ratios.

    `<name>_s` is the CUDA-graph replay time (kernels only) and `<name>_eager_s` the time of
    a call from Python, for name in triton, sdpa_gather, sdpa; ratios use the graph times.
    """
    kv, k_cache, v_cache, table = _paged_pool(batch, [context] * batch, shape, device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    scale = shape.head_dim ** -0.5
    itemsize = kv.element_size()
    nbytes = (2 * batch * context * shape.num_kv_heads + batch * shape.num_heads) * shape.head_dim * itemsize
    row: dict = {"batch": batch, "context": context, "bytes": nbytes}

    ours = ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    if hasattr(ops, "decode_plan"):
        row["splits"] = ops.decode_plan(batch, shape.num_kv_heads, table.shape[1] * shape.block_size,
                                        shape.head_dim, shape.dtype, device)[0]
    triton_fn = lambda: ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)  # noqa: E731
    q4 = q[:, :, None, :]
    gather_sdpa = lambda: _sdpa(q4, _gathered(k_cache, table, context), _gathered(v_cache, table, context), scale)  # noqa: E731
    k_dense = _gathered(k_cache, table, context).contiguous()
    v_dense = _gathered(v_cache, table, context).contiguous()
    want = _sdpa(q4, k_dense, v_dense, scale)[:, :, 0]
    row["max_abs_diff"] = float((ours.float() - want.float()).abs().max())
    sdpa_fn = lambda: _sdpa(q4, k_dense, v_dense, scale)  # noqa: E731
    for name, fn in (("triton", triton_fn), ("sdpa_gather", gather_sdpa), ("sdpa", sdpa_fn)):
        row[f"{name}_eager_s"] = timer(fn)
        row[f"{name}_s"] = _graph_time(timer, fn, row, name)
    del k_dense, v_dense

    fi = _flashinfer()
    if fi is not None and device.type == "cuda":
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            pages = table.shape[1]
            indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages
            last = torch.full((batch,), (context - 1) % shape.block_size + 1, dtype=torch.int32, device=device)
            wrapper.plan(indptr, table.flatten(), last, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         shape.block_size, q_data_type=shape.dtype, kv_data_type=shape.dtype)
            paged = kv[:, 0]  # [blocks, 2, bs, H_kv, D]: FlashInfer's NHD layout exactly
            row["flashinfer_s"] = timer(lambda: wrapper.run(q, paged))
        except Exception as e:  # noqa: BLE001 - a baseline failing must not stop the run
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
    for name in ("triton", "sdpa_gather", "sdpa", "flashinfer"):
        if f"{name}_s" in row:
            row[f"{name}_GBps"] = nbytes / row[f"{name}_s"] / 1e9
    row["triton_pct_of_copy"] = 100 * nbytes / row["triton_s"] / copy_bps
    row["triton_eager_pct_of_copy"] = 100 * nbytes / row["triton_eager_s"] / copy_bps
    row["speedup_vs_sdpa_gather_eager"] = row["sdpa_gather_eager_s"] / row["triton_eager_s"]
    row["speedup_vs_sdpa_gather"] = row["sdpa_gather_s"] / row["triton_s"]
    row["speedup_vs_sdpa"] = row["sdpa_s"] / row["triton_s"]
    if "flashinfer_s" in row:  # FlashInfer is timed eagerly only: compare eager with eager
        row["speedup_vs_flashinfer"] = row["flashinfer_s"] / row["triton_eager_s"]
    return row


def bench_decode_tiles(ops, batch: int, context: int, shape: Shape, device: torch.device, timer: Timer,
                       copy_bps: float, tiles=None) -> dict:
    """Decode at one shape with each (tile tokens, num_warps, num_stages) of `tiles` (CUDA-graph
    time, % of copy bandwidth): data for choosing the built-in decode tile on a new GPU."""
    kv, k_cache, v_cache, table = _paged_pool(batch, [context] * batch, shape, device, seed=2)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    scale = shape.head_dim ** -0.5
    nbytes = (2 * batch * context * shape.num_kv_heads + batch * shape.num_heads) * shape.head_dim * kv.element_size()
    want = ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale).float()
    row: dict = {"batch": batch, "context": context, "pct_of_copy": {}, "errors": {}}
    for cfg in tiles or SWEEP_TILES:
        name = "/".join(map(str, cfg))
        fn = lambda cfg=cfg: ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, tile_config=cfg)  # noqa: E731
        try:
            diff = float((fn().float() - want).abs().max())
            if diff > 0.05:
                raise AssertionError(f"differs from the built-in tile by {diff}")
            t = timer.graph(fn) if timer.cuda else timer(fn)
            row["pct_of_copy"][name] = 100 * nbytes / t / copy_bps
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result, not a failure
            row["errors"][name] = f"{type(e).__name__}: {e}"[:160]
            if device.type == "cuda":
                torch.cuda.synchronize()
    return row


def bench_prefill(ops, batch: int, new: int, cached: int, shape: Shape, device: torch.device,
                  timer: Timer) -> dict:
    """One prefill row: times (s) and TFLOP/s of causal attention with a cached prefix."""
    ctx = new + cached
    kv, k_cache, v_cache, table = _paged_pool(batch, [ctx] * batch, shape, device, seed=1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * new
    q = torch.randn(batch * new, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    scale = shape.head_dim ** -0.5
    # Query i (position cached + i) attends to cached + i + 1 keys; 2 matmuls of 2 FLOPs per MAC.
    attended = new * cached + new * (new + 1) // 2
    flops = 4 * batch * shape.num_heads * shape.head_dim * attended
    row: dict = {"batch": batch, "new": new, "cached": cached, "flops": flops}

    ours = ops.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale)
    row["triton_s"] = timer(lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale))

    qd = q.view(batch, new, shape.num_heads, shape.head_dim).transpose(1, 2)
    k_dense = _gathered(k_cache, table, ctx).contiguous()
    v_dense = _gathered(v_cache, table, ctx).contiguous()
    if cached == 0:
        kw = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415
        group = shape.num_heads // shape.num_kv_heads  # the mask variant takes no enable_gqa
        k_dense, v_dense = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)
        kw = {"attn_mask": causal_lower_right(new, ctx)}
    want = _sdpa(qd, k_dense, v_dense, scale, **kw).transpose(1, 2).reshape_as(q)
    row["max_abs_diff"] = float((ours.float() - want.float()).abs().max())
    row["sdpa_s"] = timer(lambda: _sdpa(qd, k_dense, v_dense, scale, **kw))
    del k_dense, v_dense

    fi = _flashinfer()
    if fi is not None and device.type == "cuda":
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            pages = table.shape[1]
            indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages
            last = torch.full((batch,), (ctx - 1) % shape.block_size + 1, dtype=torch.int32, device=device)
            wrapper.plan(cu, indptr, table.flatten(), last, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         shape.block_size, causal=True, q_data_type=shape.dtype, kv_data_type=shape.dtype)
            row["flashinfer_s"] = timer(lambda: wrapper.run(q, kv[:, 0]))
        except Exception as e:  # noqa: BLE001
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
    for name in ("triton", "sdpa", "flashinfer"):
        if f"{name}_s" in row:
            row[f"{name}_TFLOPs"] = flops / row[f"{name}_s"] / 1e12
    row["speedup_vs_sdpa"] = row["sdpa_s"] / row["triton_s"]
    return row


def bench_gather(ops, shape: Shape, device: torch.device, timer: Timer, num_blocks: int = 256,
                 layers: int = 32) -> dict:
    """Block gather (pages -> one contiguous buffer) in bytes/s (read + written), ours vs torch."""
    kv = torch.empty(num_blocks * 2, layers, 2, shape.block_size, shape.num_kv_heads, shape.head_dim,
                     dtype=shape.dtype, device=device)
    ids = torch.randperm(kv.shape[0], device=device)[:num_blocks]
    moved = 2 * num_blocks * kv[0].numel() * kv.element_size()
    ours = timer(lambda: ops.gather_blocks(kv, ids))
    torch_s = timer(lambda: reference.gather_blocks(kv, ids))
    return {"blocks": num_blocks, "block_bytes": kv[0].numel() * kv.element_size(),
            "triton_GBps": moved / ours / 1e9, "torch_GBps": moved / torch_s / 1e9, "speedup": torch_s / ours}


def run(device: torch.device, shape: Shape = Shape(), decode_batches=DECODE_BATCHES,
        decode_contexts=DECODE_CONTEXTS, prefill_cases=PREFILL_CASES, iters: int = 20,
        budget_s: float = BUDGET_S, gather: tuple[int, int] = (256, 32), ops=None,
        decode_sweep=DECODE_SWEEP) -> dict:
    """Runs every measurement and returns one JSON-able dict (times in s, rates in GB/s, TFLOP/s).

    gather: (blocks, layers) of the block-gather measurement. ops: the kernel module
    (default: triton_ops). decode_sweep: (batch, context) pairs of the decode tile
    sweep (x SWEEP_TILES), CUDA only. Rows past `budget_s` seconds are listed under "skipped".
    """
    if ops is None:
        from . import triton_ops as ops  # noqa: PLC0415 - needs triton
    import triton  # noqa: PLC0415

    t_start = time.perf_counter()
    timer = Timer(device, iters=iters)
    fi = _flashinfer()
    out: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": getattr(fi, "__version__", "unknown") if fi else None,
        "shape": {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                  "block_size": shape.block_size, "dtype": str(shape.dtype).removeprefix("torch.")},
        "iters": iters, "decode": [], "decode_tiles": [], "prefill": [], "skipped": [], "errors": [],
    }
    out["copy_GBps"] = copy_bandwidth(device, timer) / 1e9

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start > budget_s:
            out["skipped"].append(what)
            return True
        return False

    def attempt(what: str, fn: Callable[[], dict], into: list) -> None:
        if over_budget(what):
            return
        try:
            into.append(fn())
        except torch.cuda.OutOfMemoryError:
            out["skipped"].append(f"{what} (out of memory)")
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            out["errors"].append(f"{what}: {type(e).__name__}: {e}"[:500])
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for batch in decode_batches:
        for context in decode_contexts:
            attempt(f"decode b={batch} ctx={context}",
                    lambda: bench_decode(ops, batch, context, shape, device, timer, out["copy_GBps"] * 1e9),
                    out["decode"])
    for batch, new, cached in prefill_cases:
        attempt(f"prefill b={batch} new={new} cached={cached}",
                lambda: bench_prefill(ops, batch, new, cached, shape, device, timer), out["prefill"])
    if device.type == "cuda" and hasattr(ops, "decode_plan"):
        for batch, context in decode_sweep:
            attempt(f"decode tiles b={batch} ctx={context}",
                    lambda: bench_decode_tiles(ops, batch, context, shape, device, timer, out["copy_GBps"] * 1e9),
                    out["decode_tiles"])
    gathered: list = []
    attempt("gather_blocks", lambda: bench_gather(ops, shape, device, timer, *gather), gathered)
    out["gather"] = gathered[0] if gathered else None

    long = [r for r in out["decode"] if r["context"] >= 8192]
    out["summary"] = {
        "decode_min_pct_of_copy_at_8k_plus": min((r["triton_pct_of_copy"] for r in long), default=None),
        "decode_faster_than_sdpa_gather_everywhere": all(r["speedup_vs_sdpa_gather"] > 1 for r in out["decode"]),
        "decode_faster_than_sdpa_everywhere": all(r["speedup_vs_sdpa"] > 1 for r in out["decode"]),
        "decode_eager_min_pct_of_copy_at_8k_plus": min((r["triton_eager_pct_of_copy"] for r in long), default=None),
        "decode_eager_faster_than_sdpa_gather_everywhere": all(r["speedup_vs_sdpa_gather_eager"] > 1
                                                               for r in out["decode"]),
        "prefill_min_speedup_vs_sdpa": min((r["speedup_vs_sdpa"] for r in out["prefill"]), default=None),
    }
    out["elapsed_s"] = time.perf_counter() - t_start
    return out


def _table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """Plain-text table with right-aligned columns as narrow as their contents (fits a log)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _f(row: dict, key: str, fmt: str, mul: float = 1.0) -> str:
    return format(row[key] * mul, fmt) if row.get(key) is not None else "-"


def summary_text(result: dict) -> str:
    """The compact summary: targets of issue 3 and the headline ratios, a few short lines."""
    sm = result["summary"]
    pct = sm.get("decode_min_pct_of_copy_at_8k_plus")
    pct_e = sm.get("decode_eager_min_pct_of_copy_at_8k_plus")
    lines = ["summary (decode: CUDA-graph times; eager in brackets):",
             f"  decode min % of copy bandwidth at >= 8k context: {pct or 0:.0f}% [{pct_e or 0:.0f}%] (target 70%)",
             f"  decode faster than SDPA+gather at every size: {sm['decode_faster_than_sdpa_gather_everywhere']} "
             f"[{sm.get('decode_eager_faster_than_sdpa_gather_everywhere')}]; than SDPA on contiguous KV: "
             f"{sm['decode_faster_than_sdpa_everywhere']}",
             f"  prefill min x SDPA: {sm['prefill_min_speedup_vs_sdpa'] or 0:.2f}; errors {len(result['errors'])}, "
             f"skipped {len(result['skipped'])}, elapsed {result['elapsed_s']:.0f} s"]
    for r in result.get("decode_tiles", []):
        best = max(r["pct_of_copy"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        lines.append(f"  decode tile sweep b={r['batch']} ctx={r['context']}: best {best[0]} at {best[1]:.0f}% "
                     f"(built-in {r['pct_of_copy'].get('/'.join(map(str, SWEEP_TILES[0])), 0):.0f}%)")
    return "\n".join(lines)


def render_text(result: dict) -> str:
    """The result as plain-text tables (narrow columns, no terminal width needed)."""
    s = result["shape"]
    out = [f"{result['device']} torch {result['torch']} triton {result['triton']} "
           f"flashinfer {result['flashinfer'] or 'not installed'}; heads {s['num_heads']}/{s['num_kv_heads']} "
           f"head_dim {s['head_dim']} block {s['block_size']} {s['dtype']}; "
           f"device copy bandwidth {result['copy_GBps']:.0f} GB/s (read + write)", ""]
    rows = [[str(r["batch"]), str(r["context"]), str(r.get("splits", "-")), _f(r, "triton_s", ".1f", 1e6),
             _f(r, "triton_eager_s", ".1f", 1e6), _f(r, "triton_GBps", ".0f"), _f(r, "triton_pct_of_copy", ".0f"),
             _f(r, "triton_eager_pct_of_copy", ".0f"), _f(r, "sdpa_gather_s", ".1f", 1e6),
             _f(r, "sdpa_gather_eager_s", ".1f", 1e6), _f(r, "sdpa_s", ".1f", 1e6), _f(r, "flashinfer_s", ".1f", 1e6),
             _f(r, "speedup_vs_sdpa_gather", ".2f"), _f(r, "speedup_vs_sdpa_gather_eager", ".2f"),
             _f(r, "speedup_vs_sdpa", ".2f"), _f(r, "speedup_vs_flashinfer", ".2f"), _f(r, "max_abs_diff", ".1e")]
            for r in result["decode"]]
    out.append(_table("decode attention (us; graph = CUDA-graph replay, eager = launched from Python; "
                      "GB/s = K, V, Q bytes / graph time; %cp = % of copy bandwidth)",
                      ["batch", "ctx", "splits", "graph", "eager", "GB/s", "%cp", "%cp-e", "SDPA+g", "SDPA+g-e",
                       "SDPA", "FI-e", "xSDPA+g", "xSDPA+g-e", "xSDPA", "xFI-e", "maxdiff"], rows))
    for r in result["decode"]:
        errs = [f"{k}: {v}" for k, v in r.items() if k.endswith("_graph_error")]
        if errs:
            out.append("CUDA graph capture failed (eager time used): " + "; ".join(errs))
            break
    rows = [[str(r["batch"]), str(r["new"]), str(r["cached"]), _f(r, "triton_s", ".2f", 1e3),
             _f(r, "triton_TFLOPs", ".1f"), _f(r, "sdpa_s", ".2f", 1e3), _f(r, "sdpa_TFLOPs", ".1f"),
             _f(r, "flashinfer_TFLOPs", ".1f"), _f(r, "speedup_vs_sdpa", ".2f"), _f(r, "max_abs_diff", ".1e")]
            for r in result["prefill"]]
    out += ["", _table("prefill attention, causal over cached + new tokens (TFLOP/s)",
                       ["batch", "new", "cached", "ms", "TFLOP/s", "SDPA ms", "SDPA TF/s", "FI TF/s", "xSDPA",
                        "maxdiff"], rows)]
    if result.get("decode_tiles"):
        names = ["/".join(map(str, t)) for t in SWEEP_TILES]
        rows = [[str(r["batch"]), str(r["context"])] + [_f(r["pct_of_copy"], n, ".0f") for n in names]
                for r in result["decode_tiles"]]
        out += ["", _table("decode tile sweep: % of copy bandwidth (CUDA graph) per tile/num_warps/num_stages "
                           f"(built in: {names[0]})", ["batch", "ctx"] + names, rows)]
        for r in result["decode_tiles"]:
            for name, err in r["errors"].items():
                out.append(f"  tile {name} at b={r['batch']} ctx={r['context']}: {err}")
    g = result.get("gather")
    if g:
        out += ["", f"gather_blocks: {g['blocks']} blocks of {g['block_bytes'] >> 10} KiB: triton "
                f"{g['triton_GBps']:.0f} GB/s, torch indexing {g['torch_GBps']:.0f} GB/s (x{g['speedup']:.2f})"]
    for r in result["decode"] + result["prefill"]:
        if "flashinfer_error" in r:
            out.append(f"FlashInfer failed: {r['flashinfer_error']}")
            break
    out += [f"error: {err}" for err in result["errors"]]
    if result["skipped"]:
        out.append(f"skipped (time budget or memory): {', '.join(result['skipped'])}")
    out.append(summary_text(result))
    return "\n".join(out)


def render(result: dict) -> None:
    """Prints the result as plain-text tables and the summary."""
    print(render_text(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point (argv as on the command line); returns 2 with a message when no CUDA device is present."""
    p = argparse.ArgumentParser(prog="python -m mooncaked.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json-file", help="also write the JSON object to this file (tables still print)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no new rows start")
    p.add_argument("--summary-of", metavar="JSON_FILE",
                   help="print the tables and summary of a saved --json-file result and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.summary_of:
        with open(args.summary_of) as f:
            render(json.load(f))
        return 0
    if not torch.cuda.is_available():
        print("mooncaked.kernels.bench: no CUDA device; the kernel benchmark needs a GPU "
              "(the CPU path uses the torch references, see tests/test_kernels_*.py)", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError as e:
        print(f"mooncaked.kernels.bench: Triton is not importable: {e}", file=sys.stderr)
        return 2
    shape = Shape(dtype=getattr(torch, args.dtype), block_size=args.block_size)
    result = run(torch.device("cuda"), shape, budget_s=args.budget)
    code = 1 if result["errors"] else 0
    text = json.dumps(result)
    if args.json_file:
        with open(args.json_file, "w") as f:
            f.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        render(result)
    return code


if __name__ == "__main__":
    sys.exit(main())
