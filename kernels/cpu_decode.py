"""Paged decode attention for the CPU that reads the KV pages in place (Numba + LLVM IR).

The torch reference (`reference.paged_decode_attention`) gathers every running
sequence's whole context out of the pages into a new fp32 tensor padded to the
longest one, per layer and per step: at 32 sequences of 1,000 tokens that copy,
not the attention, was most of a decode step. This kernel walks each
sequence's block table and reads K and V where they lie, in the cache's dtype
(bf16 is widened to fp32 in registers), so a step's attention costs what the
KV it reads costs, and nothing scales with the longest sequence in the batch.

One pass per sequence, flash-decoding style (online softmax): the token rows'
offsets in the pages are computed once from the block table (`_row_offsets`);
then a tile of 16 tokens at a time, for each KV head and the G query heads that
share it (GQA), `_attend_tile` scores the 16 K rows, rescales the running max,
sum and output accumulator, and adds the 16 V rows. The tile is written as LLVM
IR (an intrinsic): its 16 tokens' partial dot products are reduced together
(`_combine`), 15 shuffle-and-add steps for 16 scores where a horizontal
reduction per token and head cost 4 each (that reduction bounded the two-pass
Numba kernel this replaced), and its accumulators stay in registers for the tile.
Softmax is in fp32 with q pre-scaled by scale * log2 e and a polynomial exp2
(`_exp2_vector`, the same as `_exp2_inplace`).

Pages lie anywhere in memory, so the hardware prefetcher loses the stream at
every page boundary: each row of a tile prefetches the same row of the next tile,
into L2 (prefetcht2). Prefetched into L1 instead, the next tile's 12 KiB evicted the
current one's (32 KiB L1d here) and the kernel ran at a third of the memory's speed.

The caches are passed as flat 1-D arrays of their whole storage plus element
offsets and strides; head_dim (a multiple of 16) and the GQA group are
compile-time constants. Same signature and layout as the reference (see
reference.py); numerics: fp32 accumulation, like the reference, within 1e-5
(fp32) or one bf16 rounding of the output (tests/test_cpu_decode.py).
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


def _emit_prefetch(builder, ptr, locality):
    """Emits llvm.prefetch (read, data cache) of the line at `ptr`; locality 3 fills L1,
    1 fills L2 (prefetcht2 on x86)."""
    i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(locality), i32(1)])


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hints the CPU to fetch the cache line of arr[idx] into all cache levels (llvm.prefetch)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        _emit_prefetch(builder, builder.gep(ary.data, [args[1]]), 3)
        return context.get_dummy_value()

    return sig, codegen


def _data_ptr(context, builder, aryty, ary, offset, elt):
    """An `elt` pointer to element `offset` of a Numba array value (in an intrinsic's codegen)."""
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(builder.gep(a.data, [offset]), elt.as_pointer())


@numba.njit(inline="always", **_JIT)
def _row_offsets(tables, s, n, block_size, block_stride, token_stride, rows):  # pragma: no cover
    """rows[t] = element offset of token t's row (head 0, dim 0) in the layer's cache
    (a page at a time: a division per token, by the runtime block_size, cost 20-40 cycles)."""
    for b in range((n + block_size - 1) // block_size):
        base = tables[s, b] * block_stride
        t0 = b * block_size
        for o in range(min(block_size, n - t0)):
            rows[t0 + o] = base + o * token_stride


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


TILE = 16  # tokens scored at once: one AVX-512 vector of fp32 scores
PREFETCH_TILES = 1  # how far ahead each row is prefetched
_NEG = -1e30  # the running max before any token (finite: fastmath assumes no infinities)


def _splat(builder, value, vty):
    """A vector of type vty with every lane `value`."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count))


def _exp2_vector(builder, x):
    """2 ** x per lane of a <16 x float> for x <= 0: the polynomial of `_exp2_inplace`."""
    v16 = x.type
    module = builder.module
    floor = cgutils.get_or_insert_function(module, ir.FunctionType(v16, [v16]), "llvm.floor.v16f32")
    c = lambda value: ir.Constant(v16, [value] * 16)  # noqa: E731
    y = builder.select(builder.fcmp_ordered("<", x, c(-126.0)), c(-126.0), x)
    k = builder.call(floor, [builder.fadd(y, c(0.5))])
    f = builder.fmul(builder.fsub(y, k), c(0.6931471805599453))  # e ** f with |f| <= ln2 / 2
    p = c(1.0 / 5040.0)
    for coef in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = builder.fadd(builder.fmul(p, f), c(coef))
    i32v = ir.VectorType(ir.IntType(32), 16)
    e = builder.shl(builder.add(builder.fptosi(k, i32v), ir.Constant(i32v, [127] * 16)),
                    ir.Constant(i32v, [23] * 16))
    return builder.fmul(p, builder.bitcast(e, v16))


def _online_softmax_update(builder, s, live, mp, lp, row):
    """One tile's online-softmax update of one query row (flash attention's running state).

    s: <16 x float> scores (log2 units), live: <16 x i1> the tokens that count; mp, lp:
    float* to the rows' running max and sum, updated in place at index `row` (a Python int).
    Returns (p, alpha): the tile's weights 2 ** (s - m_new) (0 where not live) and the
    rescale factor 2 ** (m_old - m_new) (every lane) for the row's output accumulator."""
    v16, f32, i32, i64 = s.type, ir.FloatType(), ir.IntType(32), ir.IntType(64)
    rmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [v16]),
                                          "llvm.vector.reduce.fmax.v16f32")
    radd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, v16]),
                                          "llvm.vector.reduce.fadd.v16f32")
    s = builder.select(live, s, ir.Constant(v16, [_NEG] * 16))
    m_at, l_at = builder.gep(mp, [i64(row)]), builder.gep(lp, [i64(row)])
    m_old = builder.load(m_at)
    m_tile = builder.call(rmax, [s], fastmath=("fast",))
    m_new = builder.select(builder.fcmp_ordered(">", m_old, m_tile), m_old, m_tile)
    alpha = _exp2_vector(builder, _splat(builder, builder.fsub(m_old, m_new), v16))
    p = _exp2_vector(builder, builder.fsub(s, _splat(builder, m_new, v16)))
    p = builder.select(live, p, ir.Constant(v16, [0.0] * 16))
    l_new = builder.call(radd, [builder.fmul(builder.load(l_at), builder.extract_element(alpha, i32(0))), p],
                         fastmath=("fast",))
    builder.store(m_new, m_at)
    builder.store(l_new, l_at)
    return p, alpha


def _combine(builder, x, y, level):
    """Halves the partial sums of two vectors of partial dot products into one.

    At `level`, x and y each hold 2 ** level tokens' partial sums, 16 >> level lanes a
    token, in token order; the result holds x's tokens then y's, half as many lanes each
    (lane pairs summed). Four levels turn 16 vectors of 16 partial sums into 16 scores:
    15 combines of two shuffles and an add, against 16 horizontal reductions of 4 steps."""
    g, n = 16 >> level, 1 << level
    half = g // 2
    first = [i * g + e for i in range(n) for e in range(half)]
    first += [16 + a for a in first]
    second = [a + half for a in first]
    i32 = ir.IntType(32)
    a = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 16), first))
    b = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 16), second))
    return builder.fadd(a, b)


@intrinsic
def _attend_tile(typingctx, kf, vf, kbase, vbase, rows, t0, valid, pf0, pf_valid, qs, head0, m, l, acc,
                 D, G):
    """One tile of online-softmax decode attention for one KV head and its G query heads.

    For the tokens t0 .. t0 + valid - 1 (valid in 1..16) of one sequence, whose rows start
    at element rows[t] of the layer's flat K/V caches (kf, vf: uint16 bf16 bits or float32;
    kbase, vbase: the KV head's element offset): scores s = qs[i] . k_t (qs: float32
    [heads * D], q scaled by scale * log2 e, so s is in log2 units) for the query heads
    i = head0 .. head0 + G - 1, then the running softmax state of those heads (m: float32
    max, l: float32 sum of 2 ** (s - m), acc: float32 [heads * D], sum of 2 ** (s - m) v_t)
    is rescaled to the new max and updated, flash-decoding style. D (a multiple of 16) and
    G are compile-time literals.

    Scores are computed 16 tokens at once: each token's D-long products leave a vector of
    16 partial sums, and `_combine` reduces the 16 vectors together, which is what makes the
    scores cheap (a horizontal reduction per token and head was the bound of the two-pass
    kernel this replaced). Rows past `valid` read token t0's row and get weight 0."""
    if not (isinstance(D, types.IntegerLiteral) and isinstance(G, types.IntegerLiteral)):
        return None
    n_chunks, group = D.literal_value // 16, G.literal_value
    bf16 = kf.dtype == types.uint16
    sig = types.void(kf, vf, kbase, vbase, rows, t0, valid, pf0, pf_valid, qs, head0, m, l, acc, D, G)

    def codegen(context, builder, signature, args):
        ty = signature.args
        kb, vb, t0_, valid_, pf0_, pfv_, h0 = (context.cast(builder, args[i], ty[i], types.int64)
                                               for i in (2, 3, 5, 6, 7, 8, 10))
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        v16 = ir.VectorType(f32, 16)
        elt = ir.IntType(16) if bf16 else f32
        velt = ir.VectorType(elt, 16)
        row_bytes = 16 * n_chunks * (2 if bf16 else 4)
        zero, head_elems = i64(0), builder.mul(h0, i64(16 * n_chunks))

        def arg_ptr(i, offset, t):  # pointer to element `offset` of array argument i, as type t
            return _data_ptr(context, builder, ty[i], args[i], offset, t)

        kp, vp, rp = arg_ptr(0, zero, elt), arg_ptr(1, zero, elt), arg_ptr(4, zero, i64)
        qp, mp, lp = arg_ptr(9, head_elems, f32), arg_ptr(11, h0, f32), arg_ptr(12, h0, f32)
        ap = arg_ptr(13, head_elems, f32)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fma.v16f32")

        def vec_at(ptr, offset, vty, align):
            return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer()), align=align)

        def row_chunks(ptr, base, t):
            """Token t's row (D elements) as fp32 vectors: bf16 widened by a shift. Also
            prefetches the same row of token t of the tile at pf0 (pages lie anywhere, so
            the hardware prefetcher loses the stream at every page boundary)."""
            ahead = builder.select(builder.icmp_signed("<", i64(t), pfv_), builder.add(pf0_, i64(t)), t0_)
            at = builder.bitcast(builder.gep(ptr, [builder.add(base, builder.load(builder.gep(rp, [ahead])))]),
                                 ir.IntType(8).as_pointer())
            for line in range(0, row_bytes, 64):  # into L2: see the module doc
                _emit_prefetch(builder, builder.gep(at, [i64(line)]), 1)
            idx = builder.select(builder.icmp_signed("<", i64(t), valid_), builder.add(t0_, i64(t)), t0_)
            start = builder.add(base, builder.load(builder.gep(rp, [idx])))
            out = []
            for c in range(n_chunks):
                raw = vec_at(ptr, builder.add(start, i64(16 * c)), velt, 2 if bf16 else 4)
                if bf16:
                    w = builder.shl(builder.zext(raw, ir.VectorType(i32, 16)), ir.Constant(ir.VectorType(i32, 16), [16] * 16))
                    raw = builder.bitcast(w, v16)
                out.append(raw)
            return out

        q = [[vec_at(qp, i64(16 * (j * n_chunks + c)), v16, 4) for c in range(n_chunks)] for j in range(group)]
        # pass over K: a binary counter of partially combined tokens per query head
        stacks = [[] for _ in range(group)]
        for t in range(TILE):
            k = row_chunks(kp, kb, t)
            for j in range(group):
                part = builder.fmul(q[j][0], k[0])
                for c in range(1, n_chunks):
                    part = builder.call(fma, [q[j][c], k[c], part])
                stack, level = stacks[j], 0
                while stack and stack[-1][0] == level:
                    part = _combine(builder, stack.pop()[1], part, level)
                    level += 1
                stack.append((level, part))
        lanes = ir.Constant(ir.VectorType(i64, 16), list(range(16)))
        live = builder.icmp_signed("<", lanes, _splat(builder, valid_, ir.VectorType(i64, 16)))
        probs, alphas = [], []
        for j in range(group):
            p, alpha = _online_softmax_update(builder, stacks[j][0][1], live, mp, lp, j)
            probs.append(p)
            alphas.append(alpha)
        acc = [[builder.fmul(vec_at(ap, i64(16 * (j * n_chunks + c)), v16, 4), alphas[j])
                for c in range(n_chunks)] for j in range(group)]
        for t in range(TILE):  # pass over V: acc += p_t v_t
            v = row_chunks(vp, vb, t)
            for j in range(group):
                pt = builder.shuffle_vector(probs[j], probs[j], ir.Constant(ir.VectorType(i32, 16), [t] * 16))
                for c in range(n_chunks):
                    acc[j][c] = builder.call(fma, [pt, v[c], acc[j][c]])
        for j in range(group):
            for c in range(n_chunks):
                builder.store(acc[j][c], builder.bitcast(builder.gep(ap, [i64(16 * (j * n_chunks + c))]),
                                                          v16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


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
    specialised on the literals bf16, D (head_dim, a multiple of 16) and G (GQA group).

    One pass over each sequence's pages, a tile of 16 tokens at a time (`_attend_tile`, every
    KV head of the tile before the next tile, so each page is read while it is in cache),
    with the next tile's rows prefetched: pages lie anywhere, so the hardware prefetcher
    loses the stream at every page boundary."""
    numba.literally(bf16)
    numba.literally(D)
    numba.literally(G)
    num_seqs, num_heads = q.shape[0], q.shape[1]
    num_kv = num_heads // G
    qs_u = np.empty(num_heads * D, np.uint32)
    qs = qs_u.view(np.float32)
    o_f = np.empty(D, np.float32)
    o_u = o_f.view(np.uint32)
    max_len = 0
    for s in range(num_seqs):
        max_len = max(max_len, lens[s])
    rows = np.empty(max_len, np.int64)
    m = np.empty(num_heads, np.float32)
    l = np.empty(num_heads, np.float32)  # noqa: E741 - the softmax denominator, as in the papers
    acc = np.empty(num_heads * D, np.float32)
    for s in range(num_seqs):
        n = lens[s]
        _row_offsets(tables, s, n, block_size, block_stride, token_stride, rows)
        for i in range(num_heads):  # q widened to fp32 and scaled by scale * log2 e
            if bf16:
                for d in range(D):
                    qs_u[i * D + d] = np.uint32(q[s, i, d]) << np.uint32(16)
                for d in range(D):
                    qs[i * D + d] *= qscale
            else:
                for d in range(D):
                    qs[i * D + d] = q[s, i, d] * qscale
        m[:] = _NEG
        l[:] = 0.0
        acc[:] = 0.0
        for t0 in range(0, n, TILE):
            valid = min(TILE, n - t0)
            pf0 = t0 + PREFETCH_TILES * TILE
            pf_valid = max(0, min(TILE, n - pf0))
            for h in range(num_kv):
                _attend_tile(kf, vf, k_off + h * head_stride, v_off + h * head_stride, rows, t0, valid,
                             pf0, pf_valid, qs, h * G, m, l, acc, D, G)
        for i in range(num_heads):
            inv = np.float32(1.0) / l[i]
            if bf16:  # round to nearest even, as torch's fp32 -> bf16 cast
                for d in range(D):
                    o_f[d] = acc[i * D + d] * inv
                for d in range(D):
                    u = o_u[d]
                    out[s, i, d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                             >> np.uint32(16))
            else:
                for d in range(D):
                    out[s, i, d] = acc[i * D + d] * inv


_KERNELS: dict[tuple[bool, int, int], object] = {}
_DTYPES = (torch.bfloat16, torch.float32)


def supports(dtype: torch.dtype, head_dim: int = 64) -> bool:
    """Whether this kernel handles a cache of `dtype` (bf16 and fp32) and `head_dim` (a
    multiple of 16: a row is whole AVX-512 vectors); others use the reference."""
    return dtype in _DTYPES and head_dim % TILE == 0


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
    Raises: ValueError for a cache dtype other than bf16/fp32 or a head_dim not a multiple
        of 16 (check `supports` first), or a layout it cannot read in place.
    """
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cpu_decode handles bf16/fp32 caches, not {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("cpu_decode needs head_dim-contiguous K/V views with equal strides")
    _, num_heads, head_dim = q.shape
    if head_dim % TILE:
        raise ValueError(f"cpu_decode needs head_dim a multiple of {TILE}, not {head_dim}")
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
