"""Torch references of the paged-attention kernels (the CPU path of the engine).

The paged KV layout, shared by the engine, the store and the transfer engine:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block (every layer's K and V for `block_size` tokens) is one contiguous
run of bytes. The attention functions take one layer's K and V as views

    k_cache = kv_cache[:, layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv_cache[:, layer, 1]

whose block stride is num_layers * 2 * block_size * num_kv_heads * head_dim
elements; token, head and dim strides are contiguous. A slot is
`block_id * block_size + offset`.

The Triton kernels in this package have the same signatures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncaked.utils import cdiv


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes new keys and values into their pages.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] views (see module doc).
        slot_mapping: int64 [num_tokens]; slot = block_id * block_size + offset; -1 skips a token.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, num_kv_heads, head_dim]: one sequence's first `length` tokens from its pages."""
    block_size = cache.shape[1]
    n_blocks = cdiv(length, block_size)
    pages = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, H, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    Args:
        q: [num_seqs, num_heads, head_dim]; num_heads a multiple of num_kv_heads (GQA).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: int32 [num_seqs, max_blocks_per_seq]; entries past a sequence's
            blocks are ignored.
        context_lens: int32 [num_seqs], tokens in the cache per sequence (including the
            query token's own K/V, already written), each >= 1.
        scale: softmax scale, usually head_dim ** -0.5.
    Returns: [num_seqs, num_heads, head_dim], q's dtype (computed in fp32).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    lens = context_lens.tolist()
    max_len = max(lens)
    n_blocks = cdiv(max_len, block_size)
    table = block_tables[:, :n_blocks].long()
    # [S, n_blocks*block_size, H_kv, D] -> [S, H_kv, L, D]
    k = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    v = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    k = k.transpose(1, 2).float()
    v = v.transpose(1, 2).float()
    qf = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [S, H_kv, group, L]
    pos = torch.arange(max_len, device=q.device)
    mask = pos[None, :] >= context_lens.to(q.device).long()[:, None]  # [S, L]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [S, H_kv, group, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a variable-length batch of new tokens over cached + new KV.

    Sequence s contributes q_len_s = cu_seqlens_q[s+1] - cu_seqlens_q[s] new tokens,
    which sit at positions context_lens[s] - q_len_s ... context_lens[s] - 1; the
    earlier positions are a cached prefix. Query i attends to every position <= its own.

    Args:
        q: [total_new_tokens, num_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; the new
            tokens' K/V are already written.
        block_tables: int32 [num_seqs, max_blocks_per_seq].
        cu_seqlens_q: int32 [num_seqs + 1], prefix sums of new tokens per sequence.
        context_lens: int32 [num_seqs], cached + new tokens per sequence.
        scale: softmax scale.
    Returns: [total_new_tokens, num_heads, head_dim], q's dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]]
        n_new = q_s.shape[0]
        if n_new == 0:
            continue
        k = _gather(k_cache, block_tables[s], ctx)  # [ctx, H_kv, D]
        v = _gather(v_cache, block_tables[s], ctx)
        # SDPA on [1, H, L, D] (a 4-D batch is what selects its fused flash kernel on the
        # CPU; 3-D inputs fall back to the math path, 2-3.6x slower here). GQA heads share
        # KV (enable_gqa). Causal "lower right": the new tokens are the last n_new of ctx.
        qh = q_s.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        if n_new == ctx:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            # The mask torch's causal_lower_right(n_new, ctx) materializes on the CPU,
            # built here: importing torch.nn.attention.bias pulls in torch._dynamo, ~3 s
            # of every node's start.
            mask = torch.ones(n_new, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n_new)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                               scale=scale, enable_gqa=group > 1)
        o = o[0]
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
    return out


ALIGNED_Q_BLOCK = 64  # query rows per SDPA call of paged_prefill_attention_aligned


def paged_prefill_attention_aligned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    context_lens: torch.Tensor, scale: float,
                                    q_block: int = ALIGNED_Q_BLOCK) -> torch.Tensor:
    """paged_prefill_attention's contract, with each query row's result the same bit for bit
    however its prompt was chunked (a whole prefill, chunks, a prefix hit's short suffix).

    SDPA's result for a row depends on the call's shapes (how many new tokens, how long
    the context, causal flag or mask: measured on AMD EPYC, a row of an 18-row chunk differs
    from the same row of a whole prefill by up to 5e-4). Here the rows go in blocks aligned
    to absolute positions (multiples of q_block): each block is one SDPA call of q_block
    query rows (rows outside the chunk zero) over keys 0 .. block end (keys past the context
    zero), with the causal mask of those positions. So a row always meets the same shapes,
    the same mask and the same values it can see; what it cannot see is masked out to
    exact zeros. Cost: some 30% more than one SDPA call at 1,000 tokens (one thread).

    Args and return as paged_prefill_attention; q_block: rows per call.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        q0, n_new = starts[s], starts[s + 1] - starts[s]
        if n_new == 0:
            continue
        p0 = ctx - n_new  # the chunk's first position
        end = cdiv(ctx, q_block) * q_block
        k = k_cache.new_zeros(end, num_kv_heads, head_dim)
        v = v_cache.new_zeros(end, num_kv_heads, head_dim)
        k[:ctx] = _gather(k_cache, block_tables[s], ctx)
        v[:ctx] = _gather(v_cache, block_tables[s], ctx)
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        for a in range(p0 // q_block * q_block, ctx, q_block):
            b = a + q_block
            lo, hi = max(a, p0), min(b, ctx)  # the chunk's rows in this block
            qb = q.new_zeros(q_block, num_heads, head_dim)
            qb[lo - a:hi - a] = q[q0 + lo - p0:q0 + hi - p0]
            mask = torch.ones(q_block, b, dtype=torch.bool, device=q.device).tril(diagonal=a)
            o = F.scaled_dot_product_attention(qb.transpose(0, 1).unsqueeze(0), kh[:, :, :b], vh[:, :, :b],
                                               attn_mask=mask, scale=scale,
                                               enable_gqa=num_heads != num_kv_heads)[0]
            out[q0 + lo - p0:q0 + hi - p0] = o.transpose(0, 1)[lo - a:hi - a]
    return out


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copies whole blocks out of the pages into one contiguous buffer.

    Args:
        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        block_ids: int64 [n].
    Returns: [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous: the
        byte layout the store and the transfer engine use for a block.
    """
    return kv_cache[block_ids.long()].contiguous()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Copies contiguous blocks (as from gather_blocks) into the pages `block_ids`."""
    kv_cache[block_ids.long()] = blocks.to(kv_cache.dtype)
