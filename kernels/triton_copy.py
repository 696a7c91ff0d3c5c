"""Triton copies in the paged KV layout: KV write by slot mapping, block gather and scatter.

`write_kv` puts each new token's K and V rows (all KV heads) into their page
slot. `gather_blocks` / `scatter_blocks` move whole blocks between the pages and
one contiguous buffer, the byte layout the store and the transfer engine use for
a block (see `reference`): since a block is one contiguous run of bytes in
`kv_cache`, each copy is a flat memcpy per block, split into CHUNK-element pieces.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_util import pow2

CHUNK = 4096  # elements per program in the block copies


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + d[None, :],
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_numel, GATHER: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    page = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:  # pages -> buffer
        src = src_ptr + page * block_numel + offs
        dst = dst_ptr + i * block_numel + offs
    else:  # buffer -> pages
        src = src_ptr + i * block_numel + offs
        dst = dst_ptr + page * block_numel + offs
    tl.store(dst, tl.load(src, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton KV write; same contract as `reference.write_kv`.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype (else cast first; any
            token/head strides).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] views, last dim contiguous.
        slot_mapping: int [num_tokens]; slot = block_id * block_size + offset; -1 skips a token.
            Slots are checked against the pool only when slot_mapping is on the host
            (checking a device tensor would cost a sync every step).
    Raises: ValueError on mismatched shapes; IndexError on a host slot outside the pool.
    """
    num_tokens, num_heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if v.shape != k.shape or tuple(k_cache.shape[2:]) != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim")
    if num_tokens == 0:
        return
    if slot_mapping.device.type == "cpu" and int(slot_mapping.max()) >= num_blocks * block_size:
        raise IndexError(f"slot {int(slot_mapping.max())} is outside a pool of {num_blocks * block_size} slots")
    k = k.to(k_cache.dtype)
    v = v.to(v_cache.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.to(k_cache.device)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, H_PAD=pow2(num_heads, 2), HEAD_DIM=head_dim, D_PAD=pow2(head_dim, 16),
        BLOCK_SIZE=block_size, num_warps=4)


def _check_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """block_ids as int64 on kv_cache's device, after checking them against the pool."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: one block is one run of bytes")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.numel():
        lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= kv_cache.shape[0]:
            raise IndexError(f"block ids {lo}..{hi} outside a pool of {kv_cache.shape[0]} blocks")
    return block_ids.to(device=kv_cache.device, dtype=torch.int64)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Triton block gather; same contract as `reference.gather_blocks`.

    Args:
        kv_cache: contiguous [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        block_ids: int [n], each in [0, num_blocks) (checked; one host sync).
    Returns: [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous.
    Raises: ValueError for a non-contiguous cache; IndexError for an id outside the pool.
    """
    ids = _check_blocks(kv_cache, block_ids)
    out = torch.empty((ids.numel(), *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    block_numel = math.prod(kv_cache.shape[1:])
    if ids.numel() and block_numel:
        _copy_blocks_kernel[(ids.numel(), triton.cdiv(block_numel, CHUNK))](
            kv_cache, out, ids, block_numel, GATHER=True, CHUNK=CHUNK, num_warps=4)
    return out


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Triton block scatter; same contract as `reference.scatter_blocks`.

    Args:
        kv_cache: contiguous [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        block_ids: int [n], each in [0, num_blocks) (checked; one host sync); duplicates
            leave one of their blocks, unspecified which (as in the reference).
        blocks: [n, num_layers, 2, block_size, num_kv_heads, head_dim], any float dtype
            (cast to the cache's); moved to the cache's device if needed.
    Raises: ValueError on a shape mismatch or non-contiguous cache; IndexError for an id
        outside the pool.
    """
    ids = _check_blocks(kv_cache, block_ids)
    if tuple(blocks.shape) != (ids.numel(), *kv_cache.shape[1:]):
        raise ValueError(f"blocks {tuple(blocks.shape)} do not match {ids.numel()} blocks of "
                         f"{tuple(kv_cache.shape[1:])}")
    # torch's cast (round to nearest even) so results match the reference bit for bit.
    blocks = blocks.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
    block_numel = math.prod(kv_cache.shape[1:])
    if ids.numel() and block_numel:
        _copy_blocks_kernel[(ids.numel(), triton.cdiv(block_numel, CHUNK))](
            blocks, kv_cache, ids, block_numel, GATHER=False, CHUNK=CHUNK, num_warps=4)
