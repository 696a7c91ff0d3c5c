"""Paged decode attention in Triton: one query token per sequence over its paged KV.

One program handles one (sequence, KV head) and all the query heads of its GQA
group, so each K/V row is read from memory once per group. It walks the
sequence's block table TILE tokens at a time, looking up each token's page (so
any block size works, and a tile may span pages or sit inside one), and keeps an
online softmax (Dao et al., FlashAttention; base-2 exponentials).

Long contexts with few (sequence, KV head) pairs would leave most SMs idle, so
the context is split along the sequence into `num_splits` ranges handled by
separate programs, each writing a partial output and its log-sum-exp; a second
kernel merges them (flash-decoding, Dao et al. 2023). `decode_num_splits`
chooses the split count: about 4 programs per SM, at least 128 tokens per split.
The launcher does no device-to-host sync and caches its plan per shape, so a decode
step can be captured in a CUDA graph (the benchmark times it both ways).

Head dims that are not powers of two (80, 96) are padded to the next power of
two with masked loads and stores; the query group is padded to at least 16 rows
because `tl.dot` needs M >= 16 on tensor cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_util import dot_in_fp32, interpreting, launch, page_rows, pow2, sm_count

LOG2E = 1.4426950408889634

# A split shorter than this many tokens costs more (its partial output, the merge) than the
# parallelism it adds: 128 tokens of one KV head are 64 KiB of bf16 K and V at head_dim 128.
MIN_TOKENS_PER_SPLIT = 128
# Aim for about this many programs per SM: with two or three resident per SM (shared memory
# for the pipelined K/V tiles), that is a few waves, so the last wave's tail stays small.
PROGRAMS_PER_SM = 4
# The merge kernel holds [MAX_SPLITS, head_dim] fp32 partial outputs in registers.
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    scale_log2, tokens_per_split,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_os, stride_oh, stride_osp,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    start = split * tokens_per_split
    if start < ctx:
        end = tl.minimum(ctx, start + tokens_per_split)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for t0 in range(start, end, TILE):
            tok = t0 + tl.arange(0, TILE)
            t_mask = tok < end
            page, off = page_rows(bt_row, tok, t_mask, BLOCK_SIZE)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_base + page[:, None] * stride_kb + off[:, None] * stride_kt + d[None, :],
                        mask=kv_mask, other=0.0)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_mask[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + page[:, None] * stride_vb + off[:, None] * stride_vt + d[None, :],
                        mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        o = acc / l_i[:, None]
        o_mask = g_mask[:, None] & d_mask[None, :]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        if SPLIT:
            tl.store(o_ptrs + split * stride_osp, o, mask=o_mask)
            tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask)
        else:
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, lens_ptr, out_ptr, tokens_per_split,
    stride_ps, stride_ph, stride_psp,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    n_splits = tl.cdiv(ctx, tokens_per_split)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    sp_mask = sp < n_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + sp, mask=sp_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(sp_mask, w, 0.0)
    part = tl.load(part_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
                   + sp[:, None] * stride_psp + d[None, :],
                   mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int,
                      tile: int) -> tuple[int, int]:
    """How many ranges to split each context into, and how many tokens each covers.

    The (sequence, KV head) programs alone leave most SMs idle at small batch (batch 1 with
    8 KV heads is 8 programs on 132 SMs), so each context is split until there are about
    PROGRAMS_PER_SM programs per SM (rounded to the nearest count, so a batch that nearly
    fills the GPU is not doubled), as long as every split still reads at least
    MIN_TOKENS_PER_SPLIT tokens; at most MAX_SPLITS.

    Args:
        num_seqs, num_kv_heads: the grid's first two dimensions.
        max_context: upper bound on context length in tokens.
        sm_count: streaming multiprocessors of the device.
        tile: tokens per kernel loop step; split lengths are multiples of it.
    Returns: (num_splits, tokens_per_split); (1, whole context rounded up to `tile`) when
        not splitting.
    """
    max_context = max(int(max_context), 1)
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = int(PROGRAMS_PER_SM * sm_count / programs + 0.5)
    most = max_context // max(MIN_TOKENS_PER_SPLIT, tile)
    splits = max(1, min(wanted, most, MAX_SPLITS))
    tokens = triton.cdiv(triton.cdiv(max_context, splits), tile) * tile
    return triton.cdiv(max_context, tokens), tokens


def _launch_configs(dtype: torch.dtype, head_dim: int, interpret: bool) -> tuple[int, list[dict]]:
    """(tile, [launch options from fastest to safest]) of the decode kernel.

    16-bit K/V with head_dim <= 128 on a GPU: 64-token tiles, 4 warps, 3 pipeline stages
    (two 16 KiB K/V tiles per stage at head_dim 128: two or three programs fit per SM on
    an H100/H200); the later entries need less shared memory. fp32 or wider heads: 32-token
    tiles. The interpreter prefers small tiles (numpy cost grows with the tile).
    """
    d_pad = pow2(head_dim, 16)
    tile = 32 if dtype.itemsize * d_pad > 256 or interpret else 64
    return tile, [dict(num_warps=4, num_stages=3), dict(num_warps=4, num_stages=2),
                  dict(num_warps=4, num_stages=1)]


def decode_plan(num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, num_splits: int | None = None) -> tuple[int, int, int]:
    """The decode launch: (num_splits, tokens_per_split, tile) for a batch.

    tile: tokens per loop step (see `_launch_configs`). num_splits: forced if given, else
    `decode_num_splits`.
    """
    return _plan(num_seqs, num_kv_heads, max(int(max_context), 1), head_dim, dtype, torch.device(device),
                 None if num_splits is None else max(1, int(num_splits)), None)[:3]


@functools.lru_cache(maxsize=4096)
def _plan(num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, dtype: torch.dtype,
          device: torch.device, num_splits: int | None,
          tile_config: tuple[int, int, int] | None) -> tuple[int, int, int, list[dict]]:
    """`decode_plan` plus the launch options, cached: a decode step repeats the same shapes,
    and host time between launches is what small-batch decode waits on."""
    if tile_config is None:
        tile, configs = _launch_configs(dtype, head_dim, interpreting(_decode_kernel))
    else:
        tile, configs = int(tile_config[0]), [dict(num_warps=int(tile_config[1]), num_stages=int(tile_config[2]))]
    if num_splits is None:
        splits, per_split = decode_num_splits(num_seqs, num_kv_heads, max_context, sm_count(device), tile)
    else:
        per_split = triton.cdiv(triton.cdiv(max_context, num_splits), tile) * tile
        splits = triton.cdiv(max_context, per_split)
    return splits, per_split, tile, configs


@functools.lru_cache(maxsize=1024)
def _constexprs(group: int, head_dim: int, block_size: int, tile: int, dot_f32: bool,
                split: bool) -> dict:
    """The decode kernel's compile-time arguments (cached: building them costs host time)."""
    return dict(GROUP=group, GROUP_PAD=pow2(group, 16), HEAD_DIM=head_dim, D_PAD=pow2(head_dim, 16),
                BLOCK_SIZE=block_size, TILE=tile, DOT_F32=dot_f32, SPLIT=split)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, num_splits: int | None = None,
                           tile_config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton paged decode attention; same contract as `reference.paged_decode_attention`.

    Host work per call is a few shape checks, cached plan look-ups, at most three
    allocations (output, partial outputs, their log-sum-exps) and one or two kernel
    launches; no device-to-host synchronisation, so the call can be captured in a CUDA
    graph (warm it up once first, so that Triton compiles outside the capture).

    Args:
        q: [num_seqs, num_heads, head_dim], fp32/fp16/bf16, last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype,
            last dim contiguous (any block/token/head strides, e.g. a layer view).
        block_tables: int32 [num_seqs, max_blocks_per_seq].
        context_lens: int32 [num_seqs], each >= 1 and <= max_blocks_per_seq * block_size.
        scale: softmax scale.
        num_splits: force the flash-decoding split count (tests, benchmarks); None lets
            `decode_num_splits` choose from block_tables' width (no host sync), so pass
            tables trimmed to the batch's longest sequence.
        tile_config: (tokens per tile, num_warps, num_stages) instead of the built-in
            choice (the benchmark's tile sweep); None for the built-in choice.
    Returns: [num_seqs, num_heads, head_dim], q's dtype (fp32 accumulation).
    Raises: ValueError on mismatched shapes or dtypes.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} disagree on head_dim or shape")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}/{v_cache.dtype}")
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError("block_tables and context_lens need one row per sequence")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    device = q.device
    if block_tables.device != device:
        block_tables = block_tables.to(device)
    if context_lens.device != device:
        context_lens = context_lens.to(device)

    group = num_heads // num_kv_heads
    splits, per_split, tile, configs = _plan(num_seqs, num_kv_heads, max(block_tables.shape[1] * block_size, 1),
                                             head_dim, q.dtype, device,
                                             None if num_splits is None else max(1, int(num_splits)),
                                             None if tile_config is None else tuple(tile_config))
    dot_f32 = dot_in_fp32(_decode_kernel, q.dtype)
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    scale_log2 = float(scale) * LOG2E
    if splits == 1:
        args = (q, k_cache, v_cache, block_tables, context_lens, out, out, scale_log2, per_split,
                q.stride(0), q.stride(1), *kv_strides, out.stride(0), out.stride(1), 0, 0, 0)
        launch(_decode_kernel, (num_seqs, num_kv_heads, 1), args, configs,
               _constexprs(group, head_dim, block_size, tile, dot_f32, False))
        return out

    d_pad = pow2(head_dim, 16)
    part = torch.empty(num_seqs, num_heads, splits, d_pad, dtype=torch.float32, device=device)
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=device)
    args = (q, k_cache, v_cache, block_tables, context_lens, part, lse, scale_log2, per_split,
            q.stride(0), q.stride(1), *kv_strides, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1))
    launch(_decode_kernel, (num_seqs, num_kv_heads, splits), args, configs,
           _constexprs(group, head_dim, block_size, tile, dot_f32, True))
    _decode_merge_kernel[(num_seqs, num_heads)](
        part, lse, context_lens, out, per_split,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=pow2(splits), num_warps=4)
    return out
