"""Paged decode attention for the CPU that reads the KV pages in place (Numba).

The torch reference (`reference.paged_decode_attention`) gathers every running
sequence's whole context out of the pages into a new fp32 tensor padded to the
longest one, per layer and per step: at 32 sequences of 1,000 tokens that copy,
not the attention, was most of a decode step. This kernel walks each
sequence's block table and reads K and V where they lie, in the cache's dtype
(bf16 is widened to fp32 in registers), so a step's attention costs what the
KV it reads costs, and nothing scales with the longest sequence in the batch.

Per (sequence, KV head): pass 1 reads K once and computes the scores of the
head's `group` query heads (GQA) into a small fp32 buffer; softmax in fp32;
pass 2 reads V once and accumulates. Same signature and layout as the reference
(see reference.py); numerics: fp32 accumulation, like the reference.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

__all__ = ["paged_decode_attention"]


def _make_kernel(bf16: bool):
    """The kernel for one cache element type (bf16 read as uint16 bits, or fp32)."""

    @numba.njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
    def kernel(q, kc, vc, tables, lens, scale, out):  # pragma: no cover - compiled
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kc.shape[1], kc.shape[2]
        group = num_heads // num_kv_heads
        max_len = 0
        for s in range(num_seqs):
            max_len = max(max_len, lens[s])
        scores = np.empty((group, max_len), np.float32)
        row_u = np.empty(head_dim, np.uint32)
        row = row_u.view(np.float32)
        acc = np.empty((group, head_dim), np.float32)
        for s in range(num_seqs):
            n = lens[s]
            for h in range(num_kv_heads):
                q0 = h * group
                # pass 1: scores = q . k over the pages, K read in place
                for t in range(n):
                    blk = tables[s, t // block_size]
                    off = t % block_size
                    if bf16:
                        for d in range(head_dim):
                            row_u[d] = np.uint32(kc[blk, off, h, d]) << 16
                    else:
                        for d in range(head_dim):
                            row[d] = kc[blk, off, h, d]
                    for j in range(group):
                        a = np.float32(0.0)
                        for d in range(head_dim):
                            a += q[s, q0 + j, d] * row[d]
                        scores[j, t] = a * scale
                # softmax (fp32)
                for j in range(group):
                    m = scores[j, 0]
                    for t in range(1, n):
                        m = max(m, scores[j, t])
                    tot = np.float32(0.0)
                    for t in range(n):
                        e = math.exp(scores[j, t] - m)
                        scores[j, t] = e
                        tot += e
                    inv = np.float32(1.0) / tot
                    for t in range(n):
                        scores[j, t] *= inv
                    for d in range(head_dim):
                        acc[j, d] = 0.0
                # pass 2: out = p . v, V read in place
                for t in range(n):
                    blk = tables[s, t // block_size]
                    off = t % block_size
                    if bf16:
                        for d in range(head_dim):
                            row_u[d] = np.uint32(vc[blk, off, h, d]) << 16
                    else:
                        for d in range(head_dim):
                            row[d] = vc[blk, off, h, d]
                    for j in range(group):
                        p = scores[j, t]
                        for d in range(head_dim):
                            acc[j, d] += p * row[d]
                for j in range(group):
                    for d in range(head_dim):
                        out[s, q0 + j, d] = acc[j, d]

    return kernel


_KERNELS = {torch.bfloat16: _make_kernel(True), torch.float32: _make_kernel(False)}


def supports(dtype: torch.dtype) -> bool:
    """Whether this kernel handles a cache of `dtype` (bf16 and fp32; others use the reference)."""
    return dtype in _KERNELS


def _np(cache: torch.Tensor) -> np.ndarray:
    """A NumPy view (no copy) of a cache view; bf16 as its uint16 bits (NumPy has no bf16)."""
    if cache.dtype == torch.bfloat16:
        cache = cache.view(torch.uint16)
    return cache.numpy()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context, KV read in place.

    Args (as reference.paged_decode_attention; CPU tensors):
        q: [num_seqs, num_heads, head_dim]; num_heads a multiple of num_kv_heads.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] views of the
            pages (any strides), bf16 or fp32.
        block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs],
            each >= 1 (the query token's own K/V already written).
        scale: softmax scale.
    Returns: [num_seqs, num_heads, head_dim], q's dtype (computed in fp32).
    Raises: KeyError for a cache dtype other than bf16/fp32 (check `supports` first).
    """
    kernel = _KERNELS[k_cache.dtype]
    qf = q.detach().float().contiguous()
    out = torch.empty(qf.shape, dtype=torch.float32)
    kernel(qf.numpy(), _np(k_cache), _np(v_cache), block_tables.numpy(),
           context_lens.numpy(), np.float32(scale), out.numpy())
    return out.to(q.dtype)
