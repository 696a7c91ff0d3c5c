"""Causal prefill attention for the CPU in bf16 (Numba + LLVM IR, AVX512-BF16).

torch's CPU flash attention (`scaled_dot_product_attention`) ran a 1,000-token
prefill of the bundled model (9 query heads, 3 KV heads, head_dim 64) at about
a quarter of the FLOP rate of the bf16 matmuls around it, and so took ~40% of a
cold prefill. This kernel is flash attention (one pass, online softmax) built on
`vdpbf16ps`, the instruction the bf16 matmuls use: it multiplies pairs of bf16
and accumulates in fp32, 32 products an instruction.

Layout is what makes that instruction fit. Per sequence, K and V are packed
once per layer (`_pack`, torch copies) into tiles of 16 tokens:

- K tile: [head_dim / 2, 16 tokens, 2]: one 64-byte vector holds the pair (2p, 2p+1)
  of every token, so 16 scores of one query row come out of head_dim / 2 `vdpbf16ps`,
  each against that query's pair p broadcast: no horizontal sums.
- V tile: [8 token pairs, head_dim, 2]: one vector holds 16 dims of two tokens, so
  `out += p V` is head_dim / 16 `vdpbf16ps` per token pair, against the two tokens'
  probabilities (rounded to bf16, as torch's kernel does) broadcast.

`_prefill_tile` (an intrinsic) runs one tile against R = 4 query rows of one head
(consecutive positions), whose scores, running max and sum stay in registers for
the tile; each K or V vector it loads serves the 4 rows. Softmax is in fp32, in
log2 units (scores scaled by scale * log2 e) with cpu_decode's polynomial exp2.

`vdpbf16ps` is emitted as inline assembly: llvmlite's IR has no bfloat type for the
LLVM intrinsic. `supports()` says whether this CPU has AVX512-BF16 (and the dtype and
head_dim fit); the ops module uses torch's SDPA otherwise.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import cpu_isa
from .cpu_decode import _JIT, _LOG2E, _NEG, _data_ptr, _online_softmax_update, _splat
from .reference import _gather

__all__ = ["paged_prefill_attention", "supports"]

llvm.initialize_native_asmparser()  # Numba's JIT parses inline assembly only with it (`_dp`)

TILE = 16  # tokens per K/V tile (the lanes of one fp32 vector)
ROWS = 4   # query rows per tile call: 4 rows' scores + 4 x head_dim/16 accumulators fit in 32 registers


def _dp(builder, acc, a, b):
    """acc (<16 x float>) + the bf16 pair products of a and b (<16 x i32>, two bf16 a lane):
    one `vdpbf16ps`."""
    v16f, v16i = acc.type, a.type
    return builder.asm(ir.FunctionType(v16f, [v16f, v16i, v16i]), "vdpbf16ps $3, $2, $0", "=v,0,v,v",
                       [acc, a, b], False, "dp")


@intrinsic
def _prefill_tile(typingctx, qw, q0, qstride, kw, k0, vw, v0, pos0, key0, scale, m, l, acc, R, D):
    """One K/V tile of online-softmax attention for R query rows of one head.

    Rows r = 0..R-1 are the bf16 pairs qw[q0 + r * qstride ...] (uint32 words, D / 2 a row)
    at positions pos0 + r; the tile's tokens are key0 .. key0 + 15, packed at kw[k0] (K:
    [D/2, 16] words) and vw[v0] (V: [8, D] words) as the module doc describes. Token t is
    visible to row r when key0 + t <= pos0 + r (causal). Updates the rows' running max m
    and sum l (float32 [R], log2 units) and output accumulator acc (float32 [R * D]) in place.
    R and D (a multiple of 16) are compile-time literals."""
    if not (isinstance(R, types.IntegerLiteral) and isinstance(D, types.IntegerLiteral)):
        return None
    rows, dim = R.literal_value, D.literal_value
    sig = types.void(qw, q0, qstride, kw, k0, vw, v0, pos0, key0, scale, m, l, acc, R, D)

    def codegen(context, builder, signature, args):
        ty = signature.args
        q0_, qs_, k0_, v0_, pos0_, key0_ = (context.cast(builder, args[i], ty[i], types.int64)
                                            for i in (1, 2, 4, 6, 7, 8))
        scale_ = context.cast(builder, args[9], ty[9], types.float32)
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        v16f, v16i, v8i = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i32, 8)
        zero = i64(0)
        qp, kp, vp = (_data_ptr(context, builder, ty[i], args[i], zero, i32) for i in (0, 3, 5))
        mp, lp, ap = (_data_ptr(context, builder, ty[i], args[i], zero, f32) for i in (10, 11, 12))

        def vload(ptr, offset, vty):
            return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer()), align=4)

        def ivec(values):
            return ir.Constant(v16i, list(values))

        # scores: s[r] = q_r . k_t for the 16 tokens, one vdpbf16ps per dim pair
        s = [ir.Constant(v16f, [0.0] * 16) for _ in range(rows)]
        qrow = [builder.add(q0_, builder.mul(qs_, i64(r))) for r in range(rows)]
        for p in range(dim // 2):
            kv = vload(kp, builder.add(k0_, i64(p * TILE)), v16i)
            for r in range(rows):
                qb = _splat(builder, builder.load(builder.gep(qp, [builder.add(qrow[r], i64(p))])), v16i)
                s[r] = _dp(builder, s[r], kv, qb)
        keys = builder.add(_splat(builder, key0_, ir.VectorType(i64, 16)),
                           ir.Constant(ir.VectorType(i64, 16), list(range(16))))
        scale_v = _splat(builder, scale_, v16f)
        pairs, accs = [], []
        for r in range(rows):
            live = builder.icmp_signed("<=", keys, _splat(builder, builder.add(pos0_, i64(r)),
                                                          ir.VectorType(i64, 16)))
            p, alpha = _online_softmax_update(builder, builder.fmul(s[r], scale_v), live, mp, lp, r)
            # p to bf16 (round to nearest even; p >= 0), then tokens (2j, 2j+1) into one word
            bits = builder.bitcast(p, v16i)
            odd = builder.and_(builder.lshr(bits, ivec([16] * 16)), ivec([1] * 16))
            rb = builder.lshr(builder.add(builder.add(bits, ivec([0x7FFF] * 16)), odd), ivec([16] * 16))
            ev = builder.shuffle_vector(rb, rb, ir.Constant(ir.VectorType(i32, 8), list(range(0, 16, 2))))
            od = builder.shuffle_vector(rb, rb, ir.Constant(ir.VectorType(i32, 8), list(range(1, 16, 2))))
            pairs.append(builder.or_(ev, builder.shl(od, ir.Constant(v8i, [16] * 8))))
            accs.append([builder.fmul(vload(ap, i64(r * dim + 16 * c), v16f), alpha) for c in range(dim // 16)])
        # out += p V: per token pair, one vdpbf16ps per 16 dims
        for j in range(TILE // 2):
            pb = [builder.shuffle_vector(pairs[r], pairs[r], ivec([j] * 16)) for r in range(rows)]
            for c in range(dim // 16):
                vv = vload(vp, builder.add(v0_, i64(j * dim + 16 * c)), v16i)
                for r in range(rows):
                    accs[r][c] = _dp(builder, accs[r][c], vv, pb[r])
        for r in range(rows):
            for c in range(dim // 16):
                builder.store(accs[r][c], builder.bitcast(builder.gep(ap, [i64(r * dim + 16 * c)]),
                                                          v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_JIT)
def attend(qw, kw, vw, out, start, n, num_heads, group, ntiles, qscale, D):  # pragma: no cover - compiled
    """Causal attention of one sequence's n new tokens (positions start .. start + n - 1)
    over its start + n tokens of packed K/V (see `_pack`).

    qw: uint32 [n_padded * num_heads * D / 2] (bf16 pairs, n_padded a multiple of ROWS);
    kw, vw: uint32 packed tiles, [kv_heads, ntiles, ...]; out: uint16 [n, num_heads, D]
    (bf16 bits); qscale: softmax scale * log2 e. D is a compile-time literal."""
    numba.literally(D)
    half = D // 2
    m = np.empty(ROWS, np.float32)
    l = np.empty(ROWS, np.float32)  # noqa: E741 - the softmax denominator, as in the papers
    acc = np.empty(ROWS * D, np.float32)
    o_f = np.empty(D, np.float32)
    o_u = o_f.view(np.uint32)
    ctx = start + n
    for h in range(num_heads):
        g = h // group
        for i0 in range(0, n, ROWS):
            m[:] = _NEG
            l[:] = 0.0
            acc[:] = 0.0
            last = min(start + i0 + ROWS, ctx) - 1  # the block's last visible token
            for t in range(last // TILE + 1):
                tile = g * ntiles + t
                _prefill_tile(qw, (i0 * num_heads + h) * half, num_heads * half, kw, tile * half * TILE,
                              vw, tile * (TILE // 2) * D, start + i0, t * TILE, qscale, m, l, acc, ROWS, D)
            for r in range(min(ROWS, n - i0)):
                inv = np.float32(1.0) / l[r]
                for d in range(D):
                    o_f[d] = acc[r * D + d] * inv
                for d in range(D):  # round to nearest even, as torch's fp32 -> bf16 cast
                    u = o_u[d]
                    out[i0 + r, h, d] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                                                  >> np.uint32(16))


def _make_kernel(D: int):
    """`attend` specialised on head_dim D. A jitted function of plain values calling `attend`
    with D as a literal: called from Python directly, `numba.literally` re-dispatches on
    every call (27 ms a call here, more than the attention itself); cpu_decode._make_kernel
    has the same shape for the same reason."""

    @numba.njit(**_JIT)
    def kernel(qw, kw, vw, out, start, n, num_heads, group, ntiles, qscale):  # pragma: no cover
        attend(qw, kw, vw, out, start, n, num_heads, group, ntiles, qscale, D)

    return kernel


_KERNELS: dict[int, object] = {}


def _pack(k: torch.Tensor, v: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """K, V bf16 [ctx, kv_heads, D] -> uint32 words of K tiles [kv_heads, ntiles, D/2, 16]
    and V tiles [kv_heads, ntiles, 8, D] (bf16 pairs, see the module doc), and ntiles.
    Tokens past ctx are zeros (masked by position in the kernel)."""
    ctx, kv_heads, dim = k.shape
    ntiles = -(-ctx // TILE)
    pad = ntiles * TILE - ctx
    if pad:
        k = torch.cat([k, k.new_zeros(pad, kv_heads, dim)])
        v = torch.cat([v, v.new_zeros(pad, kv_heads, dim)])
    kt = k.view(ntiles, TILE, kv_heads, dim // 2, 2).permute(2, 0, 3, 1, 4).contiguous()
    vt = v.view(ntiles, TILE // 2, 2, kv_heads, dim).permute(3, 0, 1, 4, 2).contiguous()
    return (kt.view(torch.int32).numpy().view(np.uint32).reshape(-1),
            vt.view(torch.int32).numpy().view(np.uint32).reshape(-1), ntiles)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this kernel runs here: a bf16 cache, head_dim a multiple of 16, and a CPU
    at ISA level avx512_bf16 (cpu_isa, which MOONCAKED_CPU_ISA can cap); otherwise use
    torch's SDPA."""
    return cpu_isa.has("avx512_bf16") and dtype == torch.bfloat16 and head_dim % TILE == 0


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.paged_prefill_attention's contract (causal attention of each sequence's new
    tokens over its cached + new KV) for bf16 CPU caches on AVX512-BF16 CPUs.

    Args:
        q: bf16 [total_new_tokens, num_heads, head_dim].
        k_cache, v_cache: bf16 [num_blocks, block_size, num_kv_heads, head_dim], the new
            tokens' K/V already written.
        block_tables: int32 [num_seqs, max_blocks]; cu_seqlens_q: int32 [num_seqs + 1];
            context_lens: int32 [num_seqs] (cached + new tokens).
        scale: softmax scale.
    Returns: bf16 [total_new_tokens, num_heads, head_dim]. Numerics: fp32 scores and sums,
        probabilities rounded to bf16 for the V product (as torch's CPU flash kernel does).
    Raises: ValueError where `supports` does not hold (or q or V is not bf16), where
        num_heads is not a multiple of num_kv_heads, or where a sequence's context_lens
        is below its new tokens or above what its block table row holds (the
        kernel would read past its packed K/V).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    if (not supports(k_cache.dtype, head_dim) or q.dtype != torch.bfloat16
            or v_cache.dtype != torch.bfloat16):
        raise ValueError(f"cpu_prefill needs bf16 q/KV, head_dim % {TILE} == 0 and AVX512-BF16")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    group = num_heads // k_cache.shape[2]
    capacity = block_tables.shape[1] * k_cache.shape[1]  # tokens a block table row can address
    kernel = _KERNELS.get(head_dim)
    if kernel is None:
        kernel = _KERNELS[head_dim] = _make_kernel(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype)  # contiguous whatever q's strides: rows are written in place
    starts = cu_seqlens_q.tolist()
    qscale = np.float32(scale * _LOG2E)
    for s, ctx in enumerate(context_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        n = b - a
        if n == 0:
            continue
        if not n <= ctx <= capacity:
            raise ValueError(f"sequence {s}: context_lens {ctx} must be >= its {n} new tokens and "
                             f"<= the {capacity} tokens its block table row holds")
        kw, vw, ntiles = _pack(_gather(k_cache, block_tables[s], ctx), _gather(v_cache, block_tables[s], ctx))
        n_pad = -(-n // ROWS) * ROWS
        qs = q.new_zeros(n_pad, num_heads, head_dim)
        qs[:n] = q[a:b]
        o = out[a:b]
        kernel(qs.view(torch.int32).numpy().view(np.uint32).reshape(-1), kw, vw,
               o.view(torch.uint16).numpy(), ctx - n, n, num_heads, group, ntiles, qscale)
    return out
