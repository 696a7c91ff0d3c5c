"""The CPU kernel set: the torch references, with decode attention from cpu_decode (Numba).

Same functions and signatures as `reference` (see its module doc for the paged KV
layout); `paged_decode_attention` reads the pages in place instead of gathering
each sequence's context (kernels/cpu_decode.py), `write_kv` is one Numba call
instead of eight torch ops, and `rms_norm` (which the model uses when its ops
module has one) likewise (kernels/cpu_fused.py). Caches of dtypes the Numba
kernels do not handle (e.g. fp16) use the reference.
"""

from __future__ import annotations

import torch

from . import cpu_decode
from .cpu_fused import rms_norm, rotary_, write_kv
from .reference import gather_blocks, paged_prefill_attention, scatter_blocks
from .reference import paged_decode_attention as _reference_decode

__all__ = ["gather_blocks", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "rotary_", "scatter_blocks", "write_kv"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """reference.paged_decode_attention's contract, KV read in place (cpu_decode) for
    bf16/fp32 CPU caches; other dtypes or devices fall back to the reference."""
    if (k_cache.device.type == "cpu" and cpu_decode.supports(k_cache.dtype, q.shape[-1])
            and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()):
        return cpu_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _reference_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
