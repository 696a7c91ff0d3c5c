"""The CPU kernel set: the torch references, with decode attention from cpu_decode (Numba).

Same functions and signatures as `reference` (see its module doc for the paged KV
layout); `paged_decode_attention` reads the pages in place instead of gathering
each sequence's context (kernels/cpu_decode.py), `paged_prefill_attention` runs
bf16 on AVX512-BF16 (kernels/cpu_prefill.py), `write_kv` is one Numba call
instead of eight torch ops, and `rms_norm` (which the model uses when its ops
module has one) likewise (kernels/cpu_fused.py). Caches of dtypes the Numba
kernels do not handle (e.g. fp16) use the reference.
"""

from __future__ import annotations

import torch

from . import cpu_decode, cpu_prefill
from .cpu_fused import rms_norm, rotary_, write_kv
from .reference import gather_blocks, paged_prefill_attention_aligned, scatter_blocks
from .reference import paged_decode_attention as _reference_decode
from .reference import paged_prefill_attention as _reference_prefill

_PREFILL_KERNEL_MAX_THREADS = 2  # beyond this, SDPA's parallel heads beat the serial kernel

__all__ = ["gather_blocks", "paged_decode_attention", "paged_prefill_attention",
           "paged_prefill_attention_aligned", "prefill_path",
           "rms_norm", "rotary_", "scatter_blocks", "write_kv"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """reference.paged_decode_attention's contract, KV read in place (cpu_decode) for
    bf16/fp32 CPU caches; other dtypes or devices fall back to the reference."""
    if (k_cache.device.type == "cpu" and cpu_decode.supports(k_cache.dtype, q.shape[-1])
            and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()):
        return cpu_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.paged_prefill_attention's contract; bf16 caches on CPUs with AVX512-BF16
    take cpu_prefill's kernel, others the reference (torch SDPA).

    The kernel runs on one thread, SDPA on torch's intra-op threads. 1,000 tokens of the
    bundled model's layer here: SDPA 23.2 ms on one thread, 15.5 ms on two; the kernel
    13.3 ms. So the kernel is used up to `_PREFILL_KERNEL_MAX_THREADS` threads. (Numba's
    parallel loops were not an option: its OpenMP layer resets torch's thread count.)"""
    if k_cache.device.type == "cpu" and prefill_path(q.dtype, k_cache.dtype, q.shape[-1]) != "sdpa":
        return cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                   context_lens, scale)
    return _reference_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def prefill_path(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                 threads: int | None = None) -> str:
    """Which variant `paged_prefill_attention` runs for a CPU cache: "cpu_prefill-avx512_bf16"
    (bf16 on AVX512-BF16, up to `_PREFILL_KERNEL_MAX_THREADS` torch threads) or "sdpa" (torch's
    scaled_dot_product_attention). threads: torch's intra-op threads, None for the current
    count. The one decision both the kernel call and the engine's report read."""
    threads = torch.get_num_threads() if threads is None else threads
    if (q_dtype == torch.bfloat16 and threads <= _PREFILL_KERNEL_MAX_THREADS
            and cpu_prefill.supports(cache_dtype, head_dim)):
        return "cpu_prefill-avx512_bf16"
    return "sdpa"
