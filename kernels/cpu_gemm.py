"""Prompt GEMM for the CPU: GGUF Q4_0/Q4_1 weights against int8 activations quantized per
block of 32, on AVX2 (also on every AVX-512 CPU, which has AVX2).

`cpu_gemv` serves decode rows: one weight row at a time, a horizontal sum per row dot.
A prompt of T tokens is a GEMM, and there that shape wastes the arithmetic. Here the
weight is repacked once (`PackedWeight`) so that one 256-bit register holds 4 consecutive
codes of 8 output columns, and a row's 4 int8 activations are broadcast against it:

    p16[r] += vpmaddubsw(W[g, b, j], broadcast(xq[r, 32 b + 4 j : 32 b + 4 j + 4]))

for j = 0..7 (a block of 32), then one `vpmaddwd` by ones leaves the block's dot products
of 8 columns in 8 int32 lanes, scaled into the fp32 accumulator by d[col, b] * dx[r, b]
(one fma), plus the block's m[col, b] * xs[r, b] (one fma). Codes are 4-bit (0..15) and
activations |xq| <= 127, so an int16 lane sums 16 products of at most 15 * 127: 30,480,
no saturation. Each weight register serves ROWS activation rows.

The arithmetic is `cpu_gemv`'s contract (`gemv_reference`: the activations rounded to int8
per block of 32, as llama.cpp's Q8 activations; the weight side exact), in another fp32
summation order: per block, the 8 partial products are exact integers, then d * dx
scales them. A row's ops do not depend on the other rows in the call (the tail of
fewer than ROWS rows takes a one-row tile with the same per-row ops), so a row's result
is the same bits in any batch (tests/test_cpu_gemm.py), which the row-invariant prompt
path needs (model/llama.py).

Measured (AMD EPYC Zen 4, one thread, compiled for AVX2 only: NUMBA_CPU_NAME=haswell,
torch capped to AVX2), 1,000 rows, the bundled model's four shapes (K x N: 576 x 960,
576 x 576, 576 x 3072, 1536 x 576), quantization included, against torch's fp32 matmul
(MKL) of the dequantized weights: 35.1 against 75.7 ms a layer (0.46x; 36.6 against 71.3
in a first run); split over two threads 20.5 ms. Relative error of the product against
the fp32 one: 0.5% (the activations' int8 rounding). At two torch threads the split
needs torch's OpenMP workers not to spin on the cores (GOMP_SPINCOUNT, set in
mooncaked/__init__.py).

Variants: "avx2" (Numba + LLVM IR over the AVX2 intrinsics) where the CPU has AVX2+FMA,
and `cpu_gemv.gemv_reference` (NumPy) as the portable contract.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu_isa
from .cpu_decode import _data_ptr
from .cpu_gemv import BLOCK, GemvWeight, quantize

__all__ = ["COLS", "ROWS", "PackedWeight", "gemm", "supported"]

COLS = 8    # output columns a register holds (8 int32 / fp32 lanes)
ROWS = 4    # activation rows a weight register serves (4 and 6 measured; 4 was faster)
# Tiling: COL_GROUPS groups of 8 columns (their weights stay in L2) by ROW_TILE rows (their
# int8 activations stay in L1/L2). Measured at 1,000 rows: (64, 64) 36.6 ms a layer,
# (16, 256) 38.0, (32, 120) with 6 rows 41.5.
COL_GROUPS = 64
ROW_TILE = 64
_JIT = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def supported() -> bool:
    """Whether this CPU runs the compiled variant (AVX2+FMA; cpu_isa, MOONCAKED_CPU_ISA caps it)."""
    return cpu_isa.has("avx2")


@dataclass(frozen=True)
class PackedWeight:
    """A 4-bit GemvWeight [N, K] repacked for `gemm` (w = d * c + m per block of 32).

    codes: uint8 [N / 8 * K / 32 * 256]: for column group g (8 columns), block b and j in
        0..7, 32 bytes: the codes of k = 32 b + 4 j .. + 3 of column 0, then of column 1, ...
    d, m: fp32 [N / 8, K / 32, 8], the block scales and minimums of the group's 8 columns.
    """

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray
    shape: tuple[int, int]

    @staticmethod
    def from_gemv(w: GemvWeight) -> PackedWeight:
        """Repacks a 4-bit GemvWeight (Q4_0 / Q4_1 codes; cpu_gemv's layout).
        Raises: ValueError for 8-bit codes (Q8_0) or N not a multiple of 8."""
        n, k = w.shape
        if w.bits != 4:
            raise ValueError("the prompt GEMM takes 4-bit codes (Q4_0 / Q4_1), not Q8_0")
        if n % COLS:
            raise ValueError(f"the prompt GEMM needs a multiple of {COLS} rows, not {n}")
        nb = k // BLOCK
        nib = w.codes.reshape(n, nb, BLOCK // 2)   # GGML order: element i low, i + 16 high
        codes = np.concatenate([nib & 15, nib >> 4], axis=2)          # [n, nb, 32]
        codes = codes.reshape(n // COLS, COLS, nb, 8, 4).transpose(0, 2, 3, 1, 4)

        def per_group(h: np.ndarray) -> np.ndarray:
            f = h.view(np.float16).astype(np.float32)                 # [n, nb]
            return np.ascontiguousarray(f.reshape(n // COLS, COLS, nb).transpose(0, 2, 1))

        return PackedWeight(np.ascontiguousarray(codes).reshape(-1), per_group(w.d),
                            per_group(w.m), (n, k))

    def nbytes(self) -> int:
        """Bytes this weight keeps in memory."""
        return self.codes.nbytes + self.d.nbytes + self.m.nbytes


def _make_tile(rows: int):
    """The code generator of `_tile_intrinsic(rows)`: `rows` activation rows by one group of 8 columns,
    over all K / 32 blocks, stored to out (see the module doc for the arithmetic)."""

    def codegen(context, builder, sig, args):
        wt, _, xt, _, _, dt, mt, _, dxt, xst, _, _, _, ot, _, _ = sig.args
        w_, wbase, x_, xbase, xstride, d_, m_, dbase, dx_, xs_, sbase, sstride, nb, o_, obase, ostride = args
        v32i8, v16i16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
        v8i32, v8f = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
        maddubs = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16i16, [v32i8, v32i8]), "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8i32, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
        wp = _data_ptr(context, builder, wt, w_, wbase, _I8)
        dp = _data_ptr(context, builder, dt, d_, dbase, _F32)
        mp = _data_ptr(context, builder, mt, m_, dbase, _F32)
        ones, zero16 = ir.Constant(v16i16, [1] * 16), ir.Constant(v16i16, [0] * 16)
        lanes0 = ir.Constant(v8i32, [0] * 8)
        xps, dxps, xsps, accs = [], [], [], []
        for r in range(rows):
            xb = xbase if r == 0 else builder.add(xbase, builder.mul(xstride, xstride.type(r)))
            sb = sbase if r == 0 else builder.add(sbase, builder.mul(sstride, sstride.type(r)))
            xps.append(_data_ptr(context, builder, xt, x_, xb, _I32))     # 4 int8 codes a load
            dxps.append(_data_ptr(context, builder, dxt, dx_, sb, _F32))
            xsps.append(_data_ptr(context, builder, xst, xs_, sb, _F32))
            accs.append(cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8)))

        def splat(scalar, vty):
            v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, _I32(0))
            return builder.shuffle_vector(v, v, lanes0)

        def vec8(ptr, b):
            return builder.load(builder.bitcast(builder.gep(ptr, [builder.mul(b, b.type(8))]),
                                                v8f.as_pointer()), align=4)

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            p16 = [zero16] * rows
            for j in range(8):
                at = builder.add(builder.mul(b, b.type(256)), b.type(32 * j))
                wv = builder.load(builder.bitcast(builder.gep(wp, [at]), v32i8.as_pointer()), align=1)
                for r in range(rows):
                    xi = builder.load(builder.gep(xps[r], [builder.add(builder.mul(b, b.type(8)), b.type(j))]),
                                      align=1)
                    xv = builder.bitcast(splat(xi, v8i32), v32i8)
                    p16[r] = builder.add(p16[r], builder.call(maddubs, [wv, xv]))
            dv, mv = vec8(dp, b), vec8(mp, b)
            for r in range(rows):   # no fast-math: a row's sums in one fixed order
                acc = builder.call(fma, [mv, splat(builder.load(builder.gep(xsps[r], [b])), v8f),
                                         builder.load(accs[r])])
                dot = builder.sitofp(builder.call(maddwd, [p16[r], ones]), v8f)
                scale = builder.fmul(dv, splat(builder.load(builder.gep(dxps[r], [b])), v8f))
                builder.store(builder.call(fma, [dot, scale, acc]), accs[r])
        op = _data_ptr(context, builder, ot, o_, obase, _F32)
        for r in range(rows):
            at = builder.gep(op, [builder.mul(ostride, ostride.type(r))])
            builder.store(builder.load(accs[r]), builder.bitcast(at, v8f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(rows: int):
    gen = _make_tile(rows)

    @intrinsic
    def tile(typingctx, w, wbase, xq, xbase, xstride, d, m, dbase, dx, xs, sbase, sstride, nb,
             out, obase, ostride):
        """tile(w, wbase, xq, xbase, xstride, d, m, dbase, dx, xs, sbase, sstride, nb, out, obase,
        ostride): out[obase + r * ostride + 0..7] = the 8 columns' products for rows r <
        `rows` (row r's xq at xbase + r * xstride, its dx / xs at sbase + r * sstride)."""
        sig = types.void(w, wbase, xq, xbase, xstride, d, m, dbase, dx, xs, sbase, sstride, nb,
                         out, obase, ostride)
        return sig, gen

    return tile


_tile_rows = _tile_intrinsic(ROWS)
_tile_one = _tile_intrinsic(1)


@numba.njit(**_JIT)
def _gemm(codes, d, m, xq, dx, xs, out, g_start, g_stop):  # pragma: no cover - compiled
    """out[:, 8 g_start : 8 g_stop] of `gemm` (column groups g_start..g_stop - 1)."""
    nb = d.shape[1]
    t, k = xq.shape
    n = out.shape[1]
    for g0 in range(g_start, g_stop, COL_GROUPS):
        g1 = min(g_stop, g0 + COL_GROUPS)
        for r0 in range(0, t, ROW_TILE):
            r1 = min(t, r0 + ROW_TILE)
            for g in range(g0, g1):
                r = r0
                while r + ROWS <= r1:
                    _tile_rows(codes, g * nb * 256, xq, r * k, k, d, m, g * nb * 8, dx, xs, r * nb, nb, nb,
                               out, r * n + g * COLS, n)
                    r += ROWS
                while r < r1:
                    _tile_one(codes, g * nb * 256, xq, r * k, k, d, m, g * nb * 8, dx, xs, r * nb, nb, nb,
                              out, r * n + g * COLS, n)
                    r += 1


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads_pool() -> ThreadPoolExecutor:
    """The process's worker threads for split GEMMs (made once, on first use; threads start
    as they are needed)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="cpu_gemm")
        return _pool


def gemm(w: PackedWeight, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """y = x . W.T with x quantized to int8 per block of 32 (cpu_gemv.gemv_reference's contract).

    Args: w: a [N, K] PackedWeight; x: fp32 [T, K]; threads: the column groups are split
        over this many threads (the kernel releases the GIL; a column's result does not
        depend on the split).
    Returns: fp32 [T, N].
    Raises: ValueError when K does not match; RuntimeError on a CPU without AVX2+FMA
        (`supported()`).
    """
    if not supported():
        raise RuntimeError(f"the prompt GEMM needs AVX2+FMA; this CPU runs {cpu_isa.isa_level()}")
    n, k = w.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [T, {k}], not {list(x.shape)}")
    xq, dx, xs = quantize(x)
    out = np.empty((x.shape[0], n), np.float32)
    groups = n // COLS
    parts = max(1, min(threads, groups))
    if parts == 1:
        _gemm(w.codes, w.d, w.m, xq, dx, xs, out, 0, groups)
        return out
    bounds = [groups * i // parts for i in range(parts + 1)]
    # the caller computes the first part itself: one hand-off fewer, and its core busy
    futures = [_threads_pool().submit(_gemm, w.codes, w.d, w.m, xq, dx, xs, out, a, b)
               for a, b in zip(bounds[1:-1], bounds[2:])]
    _gemm(w.codes, w.d, w.m, xq, dx, xs, out, bounds[0], bounds[1])
    for f in futures:
        f.result()
    return out
