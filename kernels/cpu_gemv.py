"""Quantized GEMV for the CPU: GGUF Q4_0/Q4_1/Q8_0 weights against int8 activations, as
llama.cpp computes them; one contract, a variant per ISA level (cpu_isa), chosen at start-up.

At batch 1 a decode step is a chain of matrix-vector products whose cost is the
weight bytes they read. torch's `_weight_int4pack_mm_for_cpu` reads a Q4 weight
at about 7-10 GB/s at M = 1 on an AVX-512 CPU; the VNNI variant here reads the file's
own blocks at about 20 GB/s (58 us against 104 us for the 3072 x 576 gate/up matrix,
one thread), because its inner step is one `vpdpbusd`: 64 unsigned 4/8-bit weight codes
times 64 signed int8 activations summed into 16 int32 lanes in one instruction.

Variants (`VARIANTS`, `variant()` picks the highest this CPU runs; `gemv(..., isa=)`):
- ``avx512_vnni``: Numba + LLVM IR, `vpdpbusd` (`_make_row_dot`).
- ``avx2``: Numba + LLVM IR, llama.cpp's AVX2 dot product, `vpmaddubsw` + `vpmaddwd`
  (`_make_row_dot_avx2`); the same weight and activation layout, the same results up to
  fp32 summation order. AMD EPYC (AVX2), one thread, the bundled model's 30 layers of Q4_1
  (66 MB): 1.9x faster than torch's int4 kernel, at the speed of a NumPy sum of the same
  bytes (benchmarks/gemv.py, docs/benchmarks.md).
- ``portable``: `gemv_reference` (NumPy), any CPU.
The two compiled variants share `_gemv` (the row loop and the weight prefetch); the row
dot is one intrinsic whose literal arguments select the variant's IR, so an AVX2 CPU never
compiles an AVX-512 instruction. With several activation rows (a decode step of T sequences) the AVX2
variant serves 4 rows per weight load (`_rows_dot`): each row gets the operations a lone row
gets, in the same order and without fast-math reassociation, so its bits do not depend on
the batch. AMD EPYC, one thread, same run: Q8_0 head 49152 x 576, 1 row 4.62 -> 1.53 ms
(the strict reduction also undid a slow fast-math schedule), 32 rows 44.7 -> 36.0 ms;
Q4_1 3072 x 576, 32 rows 5.7 -> 6.0 ms (no gain: the per-row dot products dominate).

Weights (`GemvWeight`): every GGUF Q4/Q8 block of 32 weights is w = d * c + m
with c an unsigned code (Q4_1: c in 0..15 and m from the file; Q4_0: m = -8 d;
Q8_0: c = q + 128, m = -128 d), kept as the file's codes: 16 bytes of nibbles a
block for 4-bit codes (GGML order: element j in byte j's low nibble, element
j + 16 in its high nibble), 32 bytes for 8-bit ones; d and m as the file's fp16.

Activations (`quantize`): each block of 32 is quantized symmetric to int8, as
llama.cpp's Q8_0/Q8_1: dx = max|x| / 127, xq = round(x / dx), and xs = dx *
sum(xq). A row's dot product is then sum over blocks of d * dx * (c . xq) + m * xs:
the weight side is exact, the error is the activation's int8 rounding (relative
error of a 576-long dot product about 0.5%, tests/test_cpu_gemv.py).

The contract is `gemv_reference` (NumPy, fp32); tests/test_fused_decode.py checks every
variant this CPU runs against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu_isa
from .cpu_decode import _data_ptr, _prefetch

__all__ = ["VARIANTS", "GemvWeight", "gemv", "gemv_reference", "quantize", "supported", "variant"]

BLOCK = 32  # weights (and activations) per GGUF block
# One contract, variants by ISA level (cpu_isa.LEVELS), lowest first: NumPy, then two Numba
# kernels whose row dot is LLVM IR over x86 intrinsics.
VARIANTS = ("portable", "avx2", "avx512_vnni")
# Software prefetch distance of the weight stream. A decode step reads each weight once
# from DRAM; the hardware prefetcher alone kept this kernel at 7.5-9 GB/s, against 13.4
# for a NumPy sum of the same bytes. Prefetching the rows 4 KiB ahead: 13.7 GB/s (30
# layers of the bundled model's shapes, 66 MB: 7.4-9.0 ms -> 4.8 ms; 1, 2, 8 KiB gave
# 10.8, 13.1, 13.7 GB/s).
PREFETCH_BYTES = 4096
_JIT = {"cache": True, "fastmath": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}
_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()


def variant() -> str:
    """The variant this CPU runs (one of VARIANTS): the highest its ISA level allows
    (cpu_isa.isa_level(), which MOONCAKED_CPU_ISA can cap); "portable" on anything else."""
    level = cpu_isa.isa_level()
    return level if level in VARIANTS else ("avx512_vnni" if cpu_isa.has("avx512_vnni") else "portable")


def supported() -> bool:
    """Whether this CPU runs a compiled variant (AVX2+FMA or AVX-512 VNNI), not only the
    portable NumPy one."""
    return variant() != "portable"


def _make_row_dot(nibbles: bool):
    """The code generator (context, builder, argtypes, args) of `_row_dot` on AVX-512 VNNI:
    row_dot(codes, cbase, xq, xbase, d, m, dbase, dx, xs, xdbase, pairs) -> float32, the dot product of one weight row with one int8 activation vector:

    4-bit codes: sum_b d[b] * dx[b] * (c_b . xq_b) + m[b] * xs[b];
    8-bit codes (Q8_0, c = q + 128, no m): sum_b d[b] * dx[b] * (c_b . xq_b - 128 sum(xq_b)),
    with xs[b] = 16 sum(xq_b) subtracted from each of the block's 8 lanes
    (`quantize(..., offset=128)`).

    The row's codes start at element cbase, its fp16 d (and m) at dbase (uint16 arrays of
    the fp16 bits), the activation's xq at xbase and its dx, xs at xdbase; `pairs` pairs of
    blocks, two blocks (64 weights) a vpdpbusd."""

    def codegen(context, builder, argtypes, args):
        ct, _, xt, _, dt, mt, _, dxt, xst, _, _ = argtypes
        c_, cbase_, x_, xbase_, d_, m_, dbase_, dx_, xs_, xdbase_, n_ = args
        v16i32, v16f, v2f = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(_F32, 2)
        v2h = ir.VectorType(ir.HalfType(), 2)
        step = 32 if nibbles else 64  # code bytes per pair of blocks
        vcode = ir.VectorType(_I8, step)
        vdot = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16i32, [v16i32] * 3), "llvm.x86.avx512.vpdpbusd.512")
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
        macc = cgutils.alloca_once_value(builder, ir.Constant(v2f, [0.0] * 2))
        cp = _data_ptr(context, builder, ct, c_, cbase_, _I8)
        xp = _data_ptr(context, builder, xt, x_, xbase_, _I8)
        dp = _data_ptr(context, builder, dt, d_, dbase_, ir.HalfType())
        mp = _data_ptr(context, builder, mt, m_, dbase_, ir.HalfType())
        dxp = _data_ptr(context, builder, dxt, dx_, xdbase_, _F32)
        xsp = _data_ptr(context, builder, xst, xs_, xdbase_, _F32)
        spread = ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8)  # block 0 | block 1 lanes

        def pair(ptr, k, vty):
            return builder.load(builder.bitcast(builder.gep(ptr, [builder.mul(k, k.type(2))]),
                                                vty.as_pointer()), align=2)

        with cgutils.for_range(builder, n_) as loop:
            k = loop.index
            w = builder.load(builder.bitcast(builder.gep(cp, [builder.mul(k, k.type(step))]),
                                             vcode.as_pointer()), align=1)
            if nibbles:  # [lo0 hi0 lo1 hi1]: elements 0..31 of block 0, then of block 1
                lo = builder.and_(w, ir.Constant(vcode, [15] * 32))
                hi = builder.lshr(w, ir.Constant(vcode, [4] * 32))
                order = [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
                w = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), order))
            x = builder.load(builder.bitcast(builder.gep(xp, [builder.mul(k, k.type(64))]),
                                             ir.VectorType(_I8, 64).as_pointer()), align=1)
            zero = ir.Constant(v16i32, [0] * 16)
            dot = builder.sitofp(builder.call(vdot, [zero, builder.bitcast(w, v16i32),
                                                     builder.bitcast(x, v16i32)]), v16f)
            dd = builder.fpext(pair(dp, k, v2h), v2f)
            ddx = pair(dxp, k, v2f)
            xs2 = pair(xsp, k, v2f)
            if nibbles:
                mm = builder.fpext(pair(mp, k, v2h), v2f)
                builder.store(builder.fadd(builder.fmul(mm, xs2, flags=["fast"]), builder.load(macc),
                                           flags=["fast"]), macc)
            else:  # c . xq - 128 sum(xq), per block
                dot = builder.fsub(dot, builder.shuffle_vector(xs2, xs2, spread), flags=["fast"])
            s2 = builder.fmul(dd, ddx, flags=["fast"])
            f = builder.fmul(dot, builder.shuffle_vector(s2, s2, spread), flags=["fast"])
            builder.store(builder.fadd(f, builder.load(acc), flags=["fast"]), acc)
        # lanes 0-7 of the accumulator hold block sums of even blocks, 8-15 of odd ones
        red = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32, v16f]), "llvm.vector.reduce.fadd.v16f32")
        r = builder.call(red, [ir.Constant(_F32, 0.0), builder.load(acc)], fastmath=("fast",))
        mv = builder.load(macc)
        return builder.fadd(r, builder.fadd(builder.extract_element(mv, _I32(0)),
                                            builder.extract_element(mv, _I32(1))))

    return codegen




ROWS = 4  # activation rows a multi-row AVX2 dot serves per weight load (`_rows_dot`)


def _make_row_dot_avx2(nibbles: bool, nrows: int = 1):
    """`_make_row_dot`'s code generator (same arguments, same result) on AVX2, as llama.cpp's AVX2
    `ggml_vec_dot_q4_1_q8_1` / `q8_0_q8_0`: `vpmaddubsw` multiplies unsigned by signed bytes
    and adds adjacent pairs into int16, `vpmaddwd` by ones adds pairs of those into int32.
    With nrows > 1 it serves nrows activation rows at once (`_rows_dot`): each pair of
    weight blocks is loaded and unpacked once for all of them, and each row gets exactly
    the operations, in the same order, that a lone row gets, so a row's result does not
    depend on how many rows share the call (no fast-math flags here: LLVM may not
    reassociate a row's sums differently in the two shapes). Extra codegen arguments for
    nrows > 1: xstride, xdstride (LLVM int64 values): the elements from one row's xq,
    and dx / xs, to the next's.

    4-bit codes, a pair of blocks a step: the 32 code bytes split into low nibbles (elements
    0..15 of block 0 | of block 1) and high nibbles (16..31 of each); the activations are
    gathered to match (a 128-bit half of each block), both halves' products are added as
    int16 (at most 4 * 15 * 127 = 7620: no saturation) and one vpmaddwd leaves block 0's
    sum in int32 lanes 0-3 and block 1's in 4-7, scaled by d * dx in one fma.

    8-bit codes (c = q + 128): vpmaddubsw's unsigned x signed pairs of 255 * 127 would
    saturate int16, so as llama.cpp it multiplies |q| by xq with q's sign (`vpsignb`),
    pairs of at most 2 * 128 * 127 = 32512, which is q . xq itself: the -128 sum(xq) term
    (`xs`) is not needed."""

    def codegen(context, builder, argtypes, args, xstride=None, xdstride=None):
        ct, _, xt, _, dt, mt, _, dxt, xst, _, _ = argtypes
        c_, cbase_, x_, xbase_, d_, m_, dbase_, dx_, xs_, xdbase_, n_ = args
        v32i8, v16i16, v8i32 = ir.VectorType(_I8, 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8)
        v8f, v4f, v2f = ir.VectorType(_F32, 8), ir.VectorType(_F32, 4), ir.VectorType(_F32, 2)
        v2h = ir.VectorType(ir.HalfType(), 2)
        maddubs = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16i16, [v32i8, v32i8]), "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8i32, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
        sign = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v32i8, [v32i8, v32i8]), "llvm.x86.avx2.psign.b")
        absf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v32i8, [v32i8, ir.IntType(1)]), "llvm.abs.v32i8")
        ones = ir.Constant(v16i16, [1] * 16)
        zero8 = ir.Constant(v8f, [0.0] * 8)
        cp = _data_ptr(context, builder, ct, c_, cbase_, _I8)
        dp = _data_ptr(context, builder, dt, d_, dbase_, ir.HalfType())
        mp = _data_ptr(context, builder, mt, m_, dbase_, ir.HalfType())
        rows = []  # per activation row: its pointers and accumulators
        for j in range(nrows):
            xb = xbase_ if j == 0 else builder.add(xbase_, builder.mul(xstride, xstride.type(j)))
            xdb = xdbase_ if j == 0 else builder.add(xdbase_, builder.mul(xdstride, xdstride.type(j)))
            rows.append({"x": _data_ptr(context, builder, xt, x_, xb, _I8),
                         "dx": _data_ptr(context, builder, dxt, dx_, xdb, _F32),
                         "xs": _data_ptr(context, builder, xst, xs_, xdb, _F32),
                         "acc": cgutils.alloca_once_value(builder, zero8),
                         "acc1": cgutils.alloca_once_value(builder, zero8),
                         "macc": cgutils.alloca_once_value(builder, ir.Constant(v2f, [0.0] * 2))})

        def pair(ptr, k, vty):
            return builder.load(builder.bitcast(builder.gep(ptr, [builder.mul(k, k.type(2))]),
                                                vty.as_pointer()), align=2)

        def bytes32(ptr, offset):
            return builder.load(builder.bitcast(builder.gep(ptr, [offset]), v32i8.as_pointer()), align=1)

        def splat(v2, lanes):
            return builder.shuffle_vector(v2, v2, ir.Constant(ir.VectorType(_I32, 8), lanes))

        with cgutils.for_range(builder, n_) as loop:
            k = loop.index
            dd = builder.fpext(pair(dp, k, v2h), v2f)
            if nibbles:  # the pair's codes, unpacked once for every row
                w = bytes32(cp, builder.mul(k, k.type(32)))
                lo = builder.and_(w, ir.Constant(v32i8, [15] * 32))
                hi = builder.and_(builder.lshr(w, ir.Constant(v32i8, [4] * 32)), ir.Constant(v32i8, [15] * 32))
                mm = builder.fpext(pair(mp, k, v2h), v2f)
            else:
                qs = [builder.xor(bytes32(cp, builder.add(builder.mul(k, k.type(64)), k.type(32 * i))),
                                  ir.Constant(v32i8, [-128] * 32)) for i in (0, 1)]
                aqs = [builder.call(absf, [q, ir.IntType(1)(0)]) for q in qs]
            for row in rows:
                x0 = bytes32(row["x"], builder.mul(k, k.type(64)))
                x1 = bytes32(row["x"], builder.add(builder.mul(k, k.type(64)), k.type(32)))
                s2 = builder.fmul(dd, pair(row["dx"], k, v2f))
                if nibbles:
                    mask = ir.VectorType(_I32, 32)
                    xlo = builder.shuffle_vector(x0, x1, ir.Constant(mask, [*range(0, 16), *range(32, 48)]))
                    xhi = builder.shuffle_vector(x0, x1, ir.Constant(mask, [*range(16, 32), *range(48, 64)]))
                    p16 = builder.add(builder.call(maddubs, [lo, xlo]), builder.call(maddubs, [hi, xhi]))
                    f = builder.sitofp(builder.call(maddwd, [p16, ones]), v8f)
                    acc = row["acc"]
                    builder.store(builder.call(fma, [f, splat(s2, [0] * 4 + [1] * 4), builder.load(acc)]), acc)
                    macc = row["macc"]
                    builder.store(builder.fadd(builder.fmul(mm, pair(row["xs"], k, v2f)), builder.load(macc)),
                                  macc)
                else:
                    for i, (xi, q, aq, acc) in enumerate(zip((x0, x1), qs, aqs, (row["acc"], row["acc1"]))):
                        p16 = builder.call(maddubs, [aq, builder.call(sign, [xi, q])])
                        f = builder.sitofp(builder.call(maddwd, [p16, ones]), v8f)
                        builder.store(builder.call(fma, [f, splat(s2, [i] * 8), builder.load(acc)]), acc)

        def half(v, vty, lanes):
            return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))

        results = []
        for row in rows:  # a fixed reduction tree: 8 -> 4 -> 2 -> 1 lanes, then the m term
            tot = builder.load(row["acc"])
            if not nibbles:
                tot = builder.fadd(tot, builder.load(row["acc1"]))
            t4 = builder.fadd(half(tot, v8f, [0, 1, 2, 3]), half(tot, v8f, [4, 5, 6, 7]))
            t2 = builder.fadd(half(t4, v4f, [0, 1]), half(t4, v4f, [2, 3]))
            r = builder.fadd(builder.extract_element(t2, _I32(0)), builder.extract_element(t2, _I32(1)))
            if nibbles:
                mv = builder.load(row["macc"])
                r = builder.fadd(r, builder.fadd(builder.extract_element(mv, _I32(0)),
                                                 builder.extract_element(mv, _I32(1))))
            results.append(r)
        if nrows == 1:
            return results[0]
        return context.make_tuple(builder, types.UniTuple(types.float32, nrows), results)

    return codegen


# (nibbles, vnni) -> the row dot's code generator
_ROW_DOT = {(n, v): (_make_row_dot if v else _make_row_dot_avx2)(n) for n in (True, False) for v in (True, False)}


@intrinsic
def _row_dot(typingctx, codes, cbase, xq, xbase, d, m, dbase, dx, xs, xdbase, pairs, nibbles, vnni):
    """row_dot(codes, cbase, xq, xbase, d, m, dbase, dx, xs, xdbase, pairs, nibbles, vnni) ->
    float32: `_make_row_dot`'s row dot (vnni True) or `_make_row_dot_avx2`'s (False), for
    4-bit codes (nibbles True) or 8-bit ones. nibbles and vnni must be literals: only the
    chosen variant's IR is generated, so no AVX-512 instruction reaches an AVX2 CPU's code
    even unoptimized."""
    if not isinstance(nibbles, types.BooleanLiteral) or not isinstance(vnni, types.BooleanLiteral):
        return None
    sig = types.float32(codes, cbase, xq, xbase, d, m, dbase, dx, xs, xdbase, pairs, nibbles, vnni)
    gen = _ROW_DOT[(nibbles.literal_value, vnni.literal_value)]

    def codegen(context, builder, signature, args):
        return gen(context, builder, signature.args[:11], args[:11])

    return sig, codegen


_ROWS_DOT = {n: _make_row_dot_avx2(n, ROWS) for n in (True, False)}


@intrinsic
def _rows_dot(typingctx, codes, cbase, xq, xbase, xstride, d, m, dbase, dx, xs, xdbase, xdstride, pairs,
              nibbles):
    """rows_dot(codes, cbase, xq, xbase, xstride, d, m, dbase, dx, xs, xdbase, xdstride, pairs,
    nibbles) -> a tuple of ROWS float32: the AVX2 row dot of one weight row with ROWS
    activation rows (row j's xq at xbase + j * xstride, its dx / xs at xdbase + j *
    xdstride), the weight codes loaded once; each result equals `_row_dot`'s for that row
    alone, bit for bit. nibbles must be a literal."""
    if not isinstance(nibbles, types.BooleanLiteral):
        return None
    sig = types.UniTuple(types.float32, ROWS)(codes, cbase, xq, xbase, xstride, d, m, dbase, dx, xs, xdbase,
                                              xdstride, pairs, nibbles)
    gen = _ROWS_DOT[nibbles.literal_value]

    def codegen(context, builder, signature, args):
        a = signature.args
        return gen(context, builder, (*a[:4], *a[5:11], a[12]), (*args[:4], *args[5:11], args[12]),
                   xstride=args[4], xdstride=args[11])

    return sig, codegen


@numba.njit(inline="always", **_JIT)
def _quantize_row(x, xq, dx, xs, offset):  # pragma: no cover - compiled
    """One activation vector x fp32 [K] -> xq int8 [K], dx fp32 [K/32], xs fp32 [K/32]:
    xs = dx * sum(xq) for 4-bit weights (offset 0); offset * sum(xq) / 8 for Q8_0 (offset
    128: the codes' +128, spread over the 8 int32 lanes a block's sums fill)."""
    for b in range(x.shape[0] // BLOCK):
        blk = x[b * BLOCK:(b + 1) * BLOCK]
        amax = np.float32(0.0)
        for i in range(BLOCK):
            amax = max(amax, abs(blk[i]))
        scale = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        q = xq[b * BLOCK:(b + 1) * BLOCK]
        tot = np.int32(0)
        for i in range(BLOCK):
            v = np.int32(np.rint(blk[i] * inv))
            q[i] = v
            tot += v
        dx[b] = scale
        xs[b] = np.float32(offset * tot / 8) if offset else scale * np.float32(tot)


@numba.njit(**_JIT)
def _quantize(x, xq, dx, xs, offset):  # pragma: no cover - compiled
    for t in range(x.shape[0]):
        _quantize_row(x[t], xq[t], dx[t], xs[t], offset)


@numba.njit(**_JIT)
def _gemv(codes, d, m, xq, dx, xs, out, nibbles, vnni):  # pragma: no cover - compiled
    """out [T, rows] fp32 = x [T, K] . W.T, each weight row read once for all T rows of x;
    specialised on the literals `nibbles` (4-bit codes, else 8-bit) and `vnni` (the
    AVX-512 VNNI row dot, else the AVX2 one: only the chosen one is compiled, so the AVX2
    variant builds on a CPU without AVX-512). Module-level functions only (no closures):
    Numba's disk cache misses closures over jitted functions."""
    numba.literally(nibbles)
    numba.literally(vnni)
    width = BLOCK // 2 if nibbles else BLOCK  # code bytes per block
    rows, nb = d.shape
    k = nb * BLOCK
    row_bytes = nb * width
    cf, df, mf = codes.reshape(-1), d.reshape(-1), m.reshape(-1)
    ahead = max(1, PREFETCH_BYTES // row_bytes)
    T = xq.shape[0]
    for r in range(rows):
        if r + ahead < rows:  # the rows PREFETCH_BYTES ahead, into all cache levels
            base = (r + ahead) * row_bytes
            for off in range(0, row_bytes, 64):
                _prefetch(cf, base + off)
            _prefetch(df, (r + ahead) * nb)
            if nibbles:
                _prefetch(mf, (r + ahead) * nb)
        t = 0
        if not vnni:  # AVX2: ROWS activation rows a call, one weight load (same bits as alone)
            while t + ROWS <= T:
                y = _rows_dot(codes, r * row_bytes, xq, t * k, k, d, m, r * nb, dx, xs, t * nb, nb, nb // 2,
                              nibbles)
                for j in range(ROWS):
                    out[t + j, r] = y[j]
                t += ROWS
        for t in range(t, T):
            out[t, r] = _row_dot(codes, r * row_bytes, xq, t * k, d, m, r * nb, dx, xs, t * nb, nb // 2,
                                 nibbles, vnni)


@numba.njit(**_JIT)
def gemv_q4(codes, d, m, xq, dx, xs, out, vnni):  # pragma: no cover - compiled
    """`_gemv` for 4-bit codes (GemvWeight.bits == 4), on its fields and `quantize`'s output;
    `vnni` a literal (True: the AVX-512 VNNI variant, False: AVX2). For jitted callers that
    pass a constant; from Python use `gemv` (a literal argument from Python re-dispatches
    on every call)."""
    numba.literally(vnni)
    _gemv(codes, d, m, xq, dx, xs, out, True, vnni)


@numba.njit(**_JIT)
def gemv_q8(codes, d, m, xq, dx, xs, out, vnni):  # pragma: no cover - compiled
    """`_gemv` for 8-bit codes (Q8_0 + 128), on its fields and `quantize(x, 128)`'s output;
    `vnni` as in `gemv_q4`."""
    numba.literally(vnni)
    _gemv(codes, d, m, xq, dx, xs, out, False, vnni)


@numba.njit(**_JIT)
def _gemv_avx2(codes, d, m, xq, dx, xs, out, nibbles):  # pragma: no cover - compiled
    """`gemv`'s AVX2 entry from Python (runtime `nibbles`, constant variant)."""
    if nibbles:
        gemv_q4(codes, d, m, xq, dx, xs, out, False)
    else:
        gemv_q8(codes, d, m, xq, dx, xs, out, False)


@numba.njit(**_JIT)
def _gemv_vnni(codes, d, m, xq, dx, xs, out, nibbles):  # pragma: no cover - compiled
    """`gemv`'s AVX-512 VNNI entry from Python (runtime `nibbles`, constant variant)."""
    if nibbles:
        gemv_q4(codes, d, m, xq, dx, xs, out, True)
    else:
        gemv_q8(codes, d, m, xq, dx, xs, out, True)


@dataclass
class GemvWeight:
    """A [rows, cols] weight as GGUF block codes for `gemv`, per block of 32:
    4-bit codes: w = d * c + m; 8-bit codes (Q8_0 + 128): w = d * (c - 128).

    codes: uint8 [rows, cols / 2] (bits 4: nibbles, GGML order) or [rows, cols] (bits 8).
    d, m: fp16 bits, uint16 [rows, cols / 32] (m is empty for 8-bit codes). The same bytes a
    weight as the file (Q4_1: 20 bytes a block, Q8_0: 34). cols is a multiple of 64
    (blocks go in pairs).
    """

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the weight matrix."""
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @staticmethod
    def from_blocks(qtype: int, blocks: np.ndarray) -> GemvWeight:
        """From a GGUF tensor's raw blocks: uint8 [rows, cols / 32, bytes a block] of GGML
        type `qtype` (2 = Q4_0: fp16 d + 16 bytes; 3 = Q4_1: fp16 d, fp16 m + 16 bytes;
        8 = Q8_0: fp16 d + 32 int8).
        Raises: ValueError for another type or cols not a multiple of 64."""
        rows, nb, _ = blocks.shape
        if nb % 2:
            raise ValueError(f"gemv needs cols a multiple of 64, not {nb * BLOCK}")
        d = blocks[..., 0:2].copy().view(np.uint16)[..., 0]
        if qtype == 3:
            m = blocks[..., 2:4].copy().view(np.uint16)[..., 0]
            return GemvWeight(blocks[..., 4:].reshape(rows, nb * 16).copy(), d, m, 4)
        if qtype == 2:  # w = (q - 8) d = d q + m with m = -8 d (exact in fp16)
            m = (-8 * d.view(np.float16)).astype(np.float16).view(np.uint16)
            return GemvWeight(blocks[..., 2:].reshape(rows, nb * 16).copy(), d, m, 4)
        if qtype == 8:
            codes = (blocks[..., 2:].reshape(rows, nb * BLOCK) ^ np.uint8(0x80)).copy()  # int8 + 128
            return GemvWeight(codes, d, np.zeros((0, 0), np.uint16), 8)
        raise ValueError(f"gemv handles GGML types 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), not {qtype}")

    @staticmethod
    def stack(parts: list[GemvWeight]) -> GemvWeight:
        """Row blocks stacked in order (e.g. [wq, wk, wv] -> one QKV weight).
        Raises: ValueError when the parts differ in bits or cols."""
        if len({(p.bits, p.shape[1]) for p in parts}) != 1:
            raise ValueError("stacked gemv weights need the same bits and cols")
        m = (np.concatenate([p.m for p in parts]) if parts[0].bits == 4 else parts[0].m)
        return GemvWeight(np.concatenate([p.codes for p in parts]), np.concatenate([p.d for p in parts]),
                          m, parts[0].bits)

    def dense(self) -> np.ndarray:
        """fp32 [rows, cols]: the weight values (exactly the file's)."""
        rows, cols = self.shape
        d = self.d.view(np.float16).astype(np.float32)[..., None]
        if self.bits == 4:
            nib = self.codes.reshape(rows, -1, 16)
            c = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.float32)
            w = c * d + self.m.view(np.float16).astype(np.float32)[..., None]
        else:
            w = (self.codes.reshape(rows, -1, BLOCK).astype(np.float32) - 128) * d
        return w.reshape(rows, cols)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """fp32 [len(ids), cols]: the rows `ids` (an embedding lookup of a tied head)."""
        sub = GemvWeight(self.codes[ids], self.d[ids], self.m[ids] if self.bits == 4 else self.m, self.bits)
        return sub.dense()

    def nbytes(self) -> int:
        """Bytes kept: codes plus fp16 d and m."""
        return self.codes.nbytes + self.d.nbytes + self.m.nbytes


def quantize(x: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations fp32 [T, K] (K a multiple of 32) -> (xq int8 [T, K], dx fp32 [T, K/32],
    xs fp32 [T, K/32]): per block of 32, dx = max|x| / 127, xq = round(x / dx), and xs =
    dx * sum(xq) (offset 0, for 4-bit weights) or 16 * sum(xq) (offset 128, for Q8_0: see
    `_quantize_row`)."""
    t, k = x.shape
    xq = np.empty((t, k), np.int8)
    dx = np.empty((t, k // BLOCK), np.float32)
    xs = np.empty((t, k // BLOCK), np.float32)
    _quantize(np.ascontiguousarray(x, np.float32), xq, dx, xs, offset)
    return xq, dx, xs


def gemv(w: GemvWeight, x: np.ndarray, isa: str | None = None) -> np.ndarray:
    """y = x . W.T with x quantized per block to int8 (see the module doc).

    Args: w: a [rows, K] GemvWeight; x: fp32 [T, K] (T small: every weight row is read
        once and used for all T rows); isa: the variant (VARIANTS), default `variant()`.
    Returns: fp32 [T, rows].
    Raises: ValueError when K does not match or `isa` is not a variant this CPU runs.
    """
    isa = variant() if isa is None else isa
    if isa not in VARIANTS or not cpu_isa.has(isa):
        raise ValueError(f"gemv variant {isa!r}: this CPU runs {', '.join(v for v in VARIANTS if cpu_isa.has(v))}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {w.shape[1]}")
    if isa == "portable":
        return gemv_reference(w, x)
    xq, dx, xs = quantize(x, 0 if w.bits == 4 else 128)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    (_gemv_vnni if isa == "avx512_vnni" else _gemv_avx2)(w.codes, w.d, w.m, xq, dx, xs, out, w.bits == 4)
    return out


def gemv_reference(w: GemvWeight, x: np.ndarray) -> np.ndarray:
    """`gemv`'s contract in NumPy (fp32 [T, rows]), the same int8 activations, for tests."""
    xq, dx, _ = quantize(x)
    xd = (xq.reshape(x.shape[0], -1, BLOCK).astype(np.float32) * dx[..., None]).reshape(x.shape)
    return xd @ w.dense().T
