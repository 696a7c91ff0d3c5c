"""Paged decode attention for the CPU that reads the KV pages in place (Numba).

The torch reference (`reference.paged_decode_attention`) gathers every running
sequence's whole context out of the pages into a new fp32 tensor padded to the
longest one, per layer and per step: at 32 sequences of 1,000 tokens that copy,
not the attention, was most of a decode step. This kernel walks each
sequence's block table and reads K and V where they lie, in the cache's dtype
(bf16 is widened to fp32 in registers), so a step's attention costs what the
KV it reads costs, and nothing scales with the longest sequence in the batch.

Per sequence: the token rows' offsets in the pages are computed once from the
block table (`_row_offsets`) and serve both passes; pass 1 reads each K row once
for all the query heads that share it (GQA) and computes scores; softmax in fp32
with an exp2 written out (`_exp2_inplace`) so that it vectorizes (Numba has no
vector exp without Intel's SVML); pass 2 reads each V row once and accumulates.
Pages lie anywhere in memory, so the hardware prefetcher loses the stream at
every page boundary: each pass prefetches the row one page ahead.

The caches are passed as flat 1-D arrays of their whole storage plus element
offsets and strides, and head_dim and the GQA group are compile-time constants,
so LLVM sees unit-stride rows of known length and vectorizes and unrolls the
inner loops. Rows are read through a slice: `kv[base + d]` with a signed base
made Numba emit its negative-index wraparound per element, a scalar gather
(the K pass alone ran 2.5x slower). Same signature and layout as the
reference (see reference.py); numerics: fp32 accumulation, like the reference.
A bf16 element is widened where it is used (`_bf16_to_f32`, a shift and a bitcast in
registers) rather than through an fp32 row buffer in memory: about 0.85-0.95x the
kernel time at 32 x 1,000 tokens (benchmarks/ figures in the commit).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["paged_decode_attention", "supports"]

_LOG2E = 1.4426950408889634

_JIT = {"cache": True, "fastmath": True, "nogil": True, "boundscheck": False}


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hints the CPU to fetch the cache line of arr[idx] into all cache levels (llvm.prefetch)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, high locality, data cache
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _bf16_to_f32(typingctx, u):
    """The float32 whose bits are the bf16 bits `u` (uint16) shifted up 16: a widen in
    registers (a bitcast), not through a buffer in memory. A float32 passes through (so
    `attend`'s bf16 branch also compiles for fp32 caches, where it is never taken)."""
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        if isinstance(signature.args[0], types.Float):
            return context.cast(builder, args[0], signature.args[0], types.float32)
        w = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(w, ir.FloatType())

    return sig, codegen


@numba.njit(inline="always", **_JIT)
def _row_offsets(tables, s, n, block_size, block_stride, token_stride, rows):  # pragma: no cover
    """rows[t] = element offset of token t's row (head 0, dim 0) in the layer's cache."""
    for t in range(n):
        rows[t] = tables[s, t // block_size] * block_stride + (t % block_size) * token_stride


@numba.njit(inline="always", **_JIT)
def _exp2_inplace(x, n, bits):  # pragma: no cover
    """x[:n] = 2 ** x[:n] for x <= 0 (relative error ~2e-7), in two vectorizable loops:
    the polynomial of the fraction, then the exponent via the float's bits."""
    for t in range(n):
        y = max(x[t], np.float32(-126.0))
        k = np.floor(y + np.float32(0.5))
        f = (y - k) * np.float32(0.6931471805599453)  # e ** f with |f| <= ln2 / 2
        p = np.float32(1.0 / 5040.0)
        p = p * f + np.float32(1.0 / 720.0)
        p = p * f + np.float32(1.0 / 120.0)
        p = p * f + np.float32(1.0 / 24.0)
        p = p * f + np.float32(1.0 / 6.0)
        p = p * f + np.float32(0.5)
        p = p * f + np.float32(1.0)
        x[t] = p * f + np.float32(1.0)
        bits[t] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for t in range(n):
        x[t] *= scale[t]


@numba.njit(inline="always", **_JIT)
def _load_row(kv, base, row, D):  # pragma: no cover - compiled
    """An fp32 row of D elements (bf16 rows are widened in registers where they are used).
    A slice, then range indices: `kv[base + d]` made Numba emit its negative-index
    wraparound per element, which turned the row load into a scalar gather (2.5x slower)."""
    src = kv[base:base + D]
    for d in range(D):
        row[d] = src[d]


@numba.njit(inline="always", **_JIT)
def _prefetch_token(kv, base, token_stride, line):  # pragma: no cover - compiled
    """Prefetches one token's row of every KV head, `line` elements a cache line."""
    for e in range(0, token_stride, line):
        _prefetch(kv, base + e)


def _make_kernel(bf16: bool, D: int, G: int):
    """The kernel for one cache element type (bf16 as uint16 bits, or fp32), head_dim D
    and GQA group G (query heads per KV head), the last two fixed at compile time.

    The kernel closes over plain values only and calls the module-level `attend` with them
    as literals: a closure over another jitted function is keyed in Numba's on-disk cache
    by that function's pickle, which differs in every process, so it was compiled anew in
    each (6.7 s here, for every engine start and test process)."""

    @numba.njit(**_JIT)
    def kernel(q, qscale, kf, k_off, vf, v_off, block_size, block_stride, token_stride, head_stride,
               tables, lens, out):  # pragma: no cover - compiled
        attend(q, qscale, kf, k_off, vf, v_off, block_size, block_stride, token_stride, head_stride,
               tables, lens, out, bf16, D, G)

    return kernel


@numba.njit(**_JIT)
def attend(q, qscale, kf, k_off, vf, v_off, block_size, block_stride, token_stride, head_stride,
           tables, lens, out, bf16, D, G):  # pragma: no cover - compiled
    """The decode attention of `paged_decode_attention` on NumPy views (q, out: [seqs, heads,
    D] in the cache's element type; kf, vf: flat caches; k_off, v_off, strides in elements),
    specialised on the literals bf16, D (head_dim) and G (GQA group)."""
    numba.literally(bf16)
    numba.literally(D)
    numba.literally(G)
    LINE = 64 // (2 if bf16 else 4)  # elements per 64-byte cache line
    num_seqs, num_heads = q.shape[0], q.shape[1]
    num_kv = num_heads // G
    qs_u = np.empty((num_heads, D), np.uint32)
    qs = qs_u.view(np.float32)
    o_f = np.empty(D, np.float32)
    o_u = o_f.view(np.uint32)
    max_len = 0
    for s in range(num_seqs):
        max_len = max(max_len, lens[s])
    rows = np.empty(max_len, np.int64)
    scores = np.empty((num_heads, max_len), np.float32)
    bits = np.empty(max_len, np.int32)
    row = np.empty(D, np.float32)
    acc = np.empty((num_heads, D), np.float32)
    for s in range(num_seqs):
        n = lens[s]
        _row_offsets(tables, s, n, block_size, block_stride, token_stride, rows)
        for i in range(num_heads):  # q widened to fp32 and scaled by scale * log2 e
            if bf16:
                for d in range(D):
                    qs_u[i, d] = np.uint32(q[s, i, d]) << np.uint32(16)
                for d in range(D):
                    qs[i, d] *= qscale
            else:
                for d in range(D):
                    qs[i, d] = q[s, i, d] * qscale
        # pass 1: scores (log2 units: q carries scale * log2 e), each K row read once
        for t in range(n):
            if t + block_size < n:  # the next page's row, a page ahead (pages lie anywhere)
                _prefetch_token(kf, k_off + rows[t + block_size], token_stride, LINE)
            for h in range(num_kv):
                if bf16:
                    base = k_off + rows[t] + h * head_stride
                    src = kf[base:base + D]
                    for j in range(G):
                        a = np.float32(0.0)
                        for d in range(D):
                            a += qs[h * G + j, d] * _bf16_to_f32(src[d])
                        scores[h * G + j, t] = a
                else:
                    _load_row(kf, k_off + rows[t] + h * head_stride, row, D)
                    for j in range(G):
                        a = np.float32(0.0)
                        for d in range(D):
                            a += qs[h * G + j, d] * row[d]
                        scores[h * G + j, t] = a
        # softmax numerators (fp32), normalised at the end
        for i in range(num_heads):
            m = scores[i, 0]
            for t in range(1, n):
                m = max(m, scores[i, t])
            for t in range(n):
                scores[i, t] -= m
            _exp2_inplace(scores[i], n, bits)
            for d in range(D):
                acc[i, d] = 0.0
        # pass 2: out = p . v, each V row read once
        for t in range(n):
            if t + block_size < n:
                _prefetch_token(vf, v_off + rows[t + block_size], token_stride, LINE)
            for h in range(num_kv):
                if bf16:
                    base = v_off + rows[t] + h * head_stride
                    src = vf[base:base + D]
                    for j in range(G):
                        p = scores[h * G + j, t]
                        for d in range(D):
                            acc[h * G + j, d] += p * _bf16_to_f32(src[d])
                else:
                    _load_row(vf, v_off + rows[t] + h * head_stride, row, D)
                    for j in range(G):
                        p = scores[h * G + j, t]
                        for d in range(D):
                            acc[h * G + j, d] += p * row[d]
        for i in range(num_heads):
            tot = np.float32(0.0)
            for t in range(n):
                tot += scores[i, t]
            inv = np.float32(1.0) / tot
            if bf16:  # round to nearest even, as torch's fp32 -> bf16 cast
                for d in range(D):
                    o_f[d] = acc[i, d] * inv
                for d in range(D):
                    u = o_u[d]
                    out[s, i, d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                             >> np.uint32(16))
            else:
                for d in range(D):
                    out[s, i, d] = acc[i, d] * inv


_KERNELS: dict[tuple[bool, int, int], object] = {}
_DTYPES = (torch.bfloat16, torch.float32)


def supports(dtype: torch.dtype) -> bool:
    """Whether this kernel handles a cache of `dtype` (bf16 and fp32; others use the reference)."""
    return dtype in _DTYPES


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view (no copy); bf16 as its uint16 bits (NumPy has no bf16)."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def _flat(cache: torch.Tensor) -> np.ndarray:
    """A 1-D NumPy view (no copy) of the cache's whole storage; bf16 as its uint16 bits."""
    n = cache.untyped_storage().nbytes() // cache.element_size()
    flat = cache.as_strided((n,), (1,), 0)
    if cache.dtype == torch.bfloat16:
        flat = flat.view(torch.uint16)
    return flat.numpy()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context, KV read in place.

    Args (as reference.paged_decode_attention; CPU tensors):
        q: [num_seqs, num_heads, head_dim]; num_heads a multiple of num_kv_heads.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] views of the
            pages (any strides whose head_dim stride is 1, the two with equal strides),
            bf16 or fp32.
        block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs],
            each >= 1 (the query token's own K/V already written).
        scale: softmax scale.
    Returns: [num_seqs, num_heads, head_dim] in the cache's dtype (the model's; computed
        in fp32, q converted to the cache's dtype first if it differs).
    Raises: ValueError for a cache dtype other than bf16/fp32 (check `supports` first) or
        a layout it cannot read in place.
    """
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cpu_decode handles bf16/fp32 caches, not {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("cpu_decode needs head_dim-contiguous K/V views with equal strides")
    _, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    key = (k_cache.dtype == torch.bfloat16, head_dim, group)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _make_kernel(*key)
    q = q.detach().to(k_cache.dtype)  # a no-op when q is already in the cache's dtype
    out = torch.empty(q.shape, dtype=k_cache.dtype)
    kf = _flat(k_cache)
    same = k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
    sb, st, sh, _ = k_cache.stride()
    kernel(_np(q), np.float32(scale * _LOG2E), kf, k_cache.storage_offset(),
           kf if same else _flat(v_cache), v_cache.storage_offset(),
           k_cache.shape[1], sb, st, sh, block_tables.numpy(), context_lens.numpy(), _np(out))
    return out
