"""The torch references (kernels/reference.py) against a naive per-token oracle.

The Triton tests compare against the references, so the references themselves are
checked here, in float64, against attention written out one sequence, one head and
one token at a time straight from the paged layout's definition.
"""

from __future__ import annotations

import math

import torch

from mooncaked.kernels import reference


def _row(cache: torch.Tensor, table: torch.Tensor, pos: int, kv_head: int) -> torch.Tensor:
    """The K or V row of token `pos` in the pages of one sequence (slot = block * size + offset)."""
    block_size = cache.shape[1]
    return cache[int(table[pos // block_size]), pos % block_size, kv_head]


def _attend(q: torch.Tensor, k_cache, v_cache, table, visible: int, kv_head: int, scale: float) -> torch.Tensor:
    scores = [float(q @ _row(k_cache, table, t, kv_head)) * scale for t in range(visible)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return sum(w / total * _row(v_cache, table, t, kv_head) for t, w in enumerate(weights))


def _setup(lens, block_size=16, kv_heads=2, head_dim=8, group=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=g, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-n // block_size) for n in lens)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        need = -(-n // block_size)
        table[s, :need] = perm[used:used + need].int()
        used += need
    return kv[:, 1, 0], kv[:, 1, 1], table, kv_heads * group, group


def test_decode_reference_matches_oracle():
    lens = [1, 16, 17, 40]
    k_cache, v_cache, table, heads, group = _setup(lens)
    q = torch.randn(len(lens), heads, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = reference.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), 0.3)
    for s, n in enumerate(lens):
        for h in range(heads):
            want = _attend(q[s, h], k_cache, v_cache, table[s], n, h // group, 0.3)
            torch.testing.assert_close(out[s, h], want, atol=1e-6, rtol=1e-6)


def test_prefill_reference_matches_oracle():
    spec = [(1, 1), (17, 1), (20, 20), (35, 6)]  # (context, new tokens): fresh, cached prefix
    lens = [c for c, _ in spec]
    k_cache, v_cache, table, heads, group = _setup(lens, seed=2)
    cu = [0]
    for _, n in spec:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = reference.paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor(cu, dtype=torch.int32),
                                            torch.tensor(lens, dtype=torch.int32), 0.5)
    for s, (ctx, new) in enumerate(spec):
        for i in range(new):
            pos = ctx - new + i  # the query's own position; it sees 0..pos
            for h in range(heads):
                want = _attend(q[cu[s] + i, h], k_cache, v_cache, table[s], pos + 1, h // group, 0.5)
                torch.testing.assert_close(out[cu[s] + i, h], want, atol=1e-6, rtol=1e-6)


def test_write_kv_and_block_copies_follow_the_layout():
    kv = torch.zeros(4, 2, 2, 16, 1, 4)
    k = torch.arange(1.0, 9.0).view(2, 1, 4)
    reference.write_kv(k, -k, kv[:, 1, 0], kv[:, 1, 1], torch.tensor([35, -1]))  # slot 35 = block 2, offset 3
    assert torch.equal(kv[2, 1, 0, 3, 0], k[0, 0]) and torch.equal(kv[2, 1, 1, 3, 0], -k[0, 0])
    assert int((kv != 0).sum()) == 8  # the skipped token (-1) wrote nothing
    # A gathered block is the block's own run of bytes in the pool.
    block = reference.gather_blocks(kv, torch.tensor([2]))
    per_block = kv[0].numel()
    assert torch.equal(block.flatten(), kv.flatten()[2 * per_block:3 * per_block])
    fresh = torch.zeros_like(kv)
    reference.scatter_blocks(fresh, torch.tensor([0]), block)
    assert torch.equal(fresh[0], kv[2]) and not fresh[1:].any()
