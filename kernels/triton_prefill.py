"""Paged prefill attention in Triton: a variable-length batch of new tokens over cached + new KV.

One program handles BLOCK_M new tokens of one sequence for one query head
(FlashAttention-2 tiling, Dao 2023). Sequence s's new tokens sit at positions
prefix_s .. context_s - 1, where prefix_s = context_s - q_len_s is the part
already cached (a prefix hit); query i sees every position <= its own. The K/V
of all those positions, cached and new alike, are read from the pages through
the block table, so a prefix hit and a fresh prompt run the same code.

The KV loop has two parts: tiles that every query row of the program may see in
full (no mask at all, scale folded into the base-2 exponent), then the tiles along
the causal diagonal (masked). On a GPU, fp16/bf16 tiles are chosen by a short
autotune over TUNED_CONFIGS on the first call per head_dim/dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_decode import LOG2E
from .triton_util import dot_in_fp32, interpreting, launch, page_rows, pow2


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, t0, kv_end, q_pos, d, d_mask,
                 scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 EVEN_D: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over KV positions t0 .. t0 + BLOCK_N - 1.

    MASKED=False (tiles every row sees in full): no bounds or causal masks at all, so the
    loads are plain (vectorised, pipelined) and the scale folds into one FMA per score.
    """
    tok = t0 + tl.arange(0, BLOCK_N)
    if MASKED:
        t_mask = tok < kv_end
        page, off = page_rows(bt_row, tok, t_mask, BLOCK_SIZE)
        kv_mask = t_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        off = (tok % BLOCK_SIZE).to(tl.int64)
        kv_mask = (tok >= 0)[:, None] & d_mask[None, :]  # only used when not EVEN_D
    k_ptrs = k_base + page[:, None] * stride_kb + off[:, None] * stride_kt + d[None, :]
    v_ptrs = v_base + page[:, None] * stride_vb + off[:, None] * stride_vt + d[None, :]
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & t_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:  # base-2 softmax with the log2(e)-scaled softmax scale folded into the exponent
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or not EVEN_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_F32: tl.constexpr,
):
    # Last query tiles first: they attend to the most keys, so the long programs start early
    # and the short ones fill the tail.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        ctx = tl.load(lens_ptr + seq)
        prefix = ctx - q_len
        kvh = head // GROUP
        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        m_mask = m < q_len
        d_mask = d < HEAD_DIM
        q_pos = prefix + m
        rows = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        # Positions below the first row's own position + 1 are visible to every row.
        full_end = (prefix + m_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        kv_end = prefix + tl.minimum((m_tile + 1) * BLOCK_M, q_len)
        for t0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, t0, kv_end, q_pos,
                                         d, d_mask, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                         BLOCK_SIZE, BLOCK_N, False, EVEN_D, DOT_F32)
        for t0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, t0, kv_end, q_pos,
                                         d, d_mask, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                         BLOCK_SIZE, BLOCK_N, True, EVEN_D, DOT_F32)
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# fp16/bf16 with head_dim <= 128 on a GPU: a short autotune (Triton's) on the first call per
# (head_dim, block size, GQA group, dtype) picks one of these. FlashAttention-2-style tiles for
# H100/H200-class GPUs: 128 query rows over 8 warps, 64- or 128-token K/V tiles, 2-3 stages
# of K/V in shared memory; and a 64-row tile for batches with few query tiles.
TUNED_CONFIGS = (
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
)


@functools.lru_cache(maxsize=1)
def _autotuned():
    """`_prefill_kernel` wrapped in triton.autotune over TUNED_CONFIGS (built on first use, so
    that importing this module under the interpreter never touches the GPU benchmarker)."""
    configs = [triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]},
                             num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in TUNED_CONFIGS]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "BLOCK_SIZE", "GROUP", "DOT_F32"])(_prefill_kernel)


def _configs(q: torch.Tensor, d_pad: int, interpret: bool) -> list[dict] | None:
    """Tile configs from fastest to safest (shared memory shrinks down the list); None
    means: autotune over TUNED_CONFIGS."""
    if interpret:  # small tiles: cheap in numpy, and small tests still cross tiles
        return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]
    if q.element_size() * d_pad <= 256:  # fp16/bf16 with head_dim <= 128
        return None
    return [dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
            dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton paged prefill attention; same contract as `reference.paged_prefill_attention`.

    Args:
        q: [total_new_tokens, num_heads, head_dim], fp32/fp16/bf16, last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; the
            new tokens' K/V already written (see `write_kv`).
        block_tables: int32 [num_seqs, max_blocks_per_seq].
        cu_seqlens_q: int32 [num_seqs + 1], prefix sums of new tokens per sequence.
        context_lens: int32 [num_seqs], cached + new tokens per sequence (>= new tokens).
        scale: softmax scale.
    Returns: [total_new_tokens, num_heads, head_dim], q's dtype. Sizes the grid from the
        longest new-token count when cu_seqlens_q is on the host, else from an upper bound
        (no device-to-host sync).
    Raises: ValueError on mismatched shapes or dtypes.
    """
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    num_seqs = context_lens.shape[0]
    if kv_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} disagree on head_dim or shape")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}/{v_cache.dtype}")
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("cu_seqlens_q needs num_seqs + 1 entries and block_tables num_seqs rows")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if total == 0 or num_seqs == 0:
        return out
    if cu_seqlens_q.is_cuda:
        # No device-to-host read inside a step: every sequence has at least one new token,
        # so none has more than total - (num_seqs - 1); programs past a sequence's own
        # length exit at once (exact for one sequence, the long-prompt case).
        max_q_len = total - num_seqs + 1
    else:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_tables = block_tables.to(q.device)
    cu_seqlens_q = cu_seqlens_q.to(q.device)
    context_lens = context_lens.to(q.device)

    d_pad = pow2(head_dim, 16)
    interpret = interpreting(_prefill_kernel)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, float(scale) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1))
    common = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
                  EVEN_D=d_pad == head_dim, DOT_F32=dot_in_fp32(_prefill_kernel, q.dtype))
    grid = lambda meta: (triton.cdiv(max_q_len, meta["BLOCK_M"]), num_heads, num_seqs)  # noqa: E731
    configs = _configs(q, d_pad, interpret)
    if configs is None:
        _autotuned()[grid](*args, **common)
    else:
        launch(_prefill_kernel, grid, args, configs, common)
    return out
