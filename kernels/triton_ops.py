"""Triton kernels with the signatures of `reference` (what `attention_ops` returns on CUDA).

    write_kv(k, v, k_cache, v_cache, slot_mapping)
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    gather_blocks(kv_cache, block_ids) -> blocks
    scatter_blocks(kv_cache, block_ids, blocks)

Shapes, dtypes and the paged layout are documented in `reference`. Each function
lives in a module of its own: triton_decode (split-K flash-decoding with a merge
kernel), triton_prefill (causal, variable length, cached prefix) and triton_copy.
Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run
on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

from .triton_copy import gather_blocks, scatter_blocks, write_kv
from .triton_decode import decode_num_splits, decode_plan, paged_decode_attention
from .triton_prefill import paged_prefill_attention

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "gather_blocks",
           "scatter_blocks", "decode_num_splits", "decode_plan"]
