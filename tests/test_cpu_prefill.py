"""kernels/cpu_prefill.py (bf16 causal prefill attention on AVX512-BF16) against an fp32 oracle.

The oracle is the torch reference run in fp32 on the same bf16 values; torch's own bf16
SDPA (the reference in bf16) is the yardstick: the kernel rounds the probabilities to
bf16 for the V product as that kernel does, so its error should be of the same size.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import cpu_ops, cpu_prefill, reference

pytestmark = pytest.mark.cpu_isa("avx512_bf16")


def _batch(seqs: list[tuple[int, int]], hd: int, group: int, bs: int, kv_heads: int = 3, seed: int = 0):
    """A paged batch: seqs are (cached tokens, new tokens); pages in random order, as
    strided views of layer 1 of a two-layer cache, and q a strided view (what the engine
    passes)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, 2, 2, bs, kv_heads, hd, generator=g).bfloat16()
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n].int()
        used += n
    total = sum(n for _, n in seqs)
    # q as the model passes it: a strided view of the fused QKV projection's output
    qkv = (torch.randn(total, (kv_heads * group + 2 * kv_heads) * hd, generator=g) * 3).bfloat16()
    q = qkv[:, :kv_heads * group * hd].view(total, kv_heads * group, hd)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    ctx = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    return q, cache[:, 1, 0], cache[:, 1, 1], table, cu, ctx


@pytest.mark.parametrize("hd,group,bs", [(64, 3, 16), (32, 1, 16), (128, 4, 16), (64, 3, 5), (64, 2, 32)])
def test_cpu_prefill_matches_fp32_oracle(hd, group, bs):
    # Tiles are 16 tokens and query blocks 4 rows: new-token counts that are not multiples
    # of 4, cached prefixes that end inside a tile, and block sizes other than 16 (tiles
    # that span pages) check the edges.
    seqs = [(0, 1), (0, 5), (0, 17), (30, 1), (40, 33), (0, 100), (200, 57), (0, 300)]
    q, k, v, table, cu, ctx = _batch(seqs, hd, group, bs)
    scale = hd ** -0.5
    got = cpu_prefill.paged_prefill_attention(q, k, v, table, cu, ctx, scale)
    want = reference.paged_prefill_attention(q.float(), k.float(), v.float(), table, cu, ctx, scale)
    sdpa = reference.paged_prefill_attention(q, k, v, table, cu, ctx, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err = (got.float() - want).abs().max().item()
    sdpa_err = (sdpa.float() - want).abs().max().item()
    assert err < 2e-2, err  # one bf16 rounding of p and of the output (values ~1)
    assert err <= 1.5 * sdpa_err, (err, sdpa_err)


def test_cpu_prefill_is_causal():
    """q = 0 weighs every visible token equally, so new token i (after c cached) gets the
    mean of V over positions 0 .. c + i: with V[t] = t / 16 in every dim that is
    (c + i) / 32. A token that saw one position too many or too few is off by 1/32 or more."""
    bs, kv_heads, hd = 16, 2, 64
    seqs = [(0, 50), (13, 7)]
    q, k, v, table, cu, ctx = _batch(seqs, hd, 2, bs, kv_heads)
    q.zero_()
    for s, (c, n) in enumerate(seqs):
        for t in range(c + n):
            v[table[s, t // bs], t % bs] = t / 16
    got = cpu_prefill.paged_prefill_attention(q, k, v, table, cu, ctx, 0.125).float()
    a = 0
    for c, n in seqs:
        want = (c + torch.arange(n, dtype=torch.float32)) / 32
        torch.testing.assert_close(got[a:a + n], want[:, None, None].expand(n, 2 * kv_heads, hd),
                                   atol=0, rtol=2 ** -8)  # one bf16 rounding
        a += n


def test_cpu_prefill_rescales_as_scores_grow():
    """Keys that grow along the context move each row's running max in nearly every tile,
    so every tile rescales what came before."""
    q, k, v, table, cu, ctx = _batch([(0, 400), (100, 300)], 64, 3, 16, seed=3)
    for s in range(2):
        n = int(ctx[s])
        for t in range(n):
            k[table[s, t // 16], t % 16] *= 0.1 + 4 * t / n
    got = cpu_prefill.paged_prefill_attention(q, k, v, table, cu, ctx, 0.125)
    want = reference.paged_prefill_attention(q.float(), k.float(), v.float(), table, cu, ctx, 0.125)
    assert want.abs().max() > 1.0  # not washed out to a mean of the values
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op thread count for the test (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_cpu_ops_routes_bf16_prefill_to_the_kernel_and_fp32_to_sdpa(torch_threads):
    """The serial kernel up to cpu_ops._PREFILL_KERNEL_MAX_THREADS torch threads, SDPA past
    that and for fp32 (the kernel and SDPA round differently, so the results tell them apart)."""
    q, k, v, table, cu, ctx = _batch([(0, 20), (9, 30)], 64, 3, 16)
    args = (table, cu, ctx, 0.125)
    kernel = cpu_prefill.paged_prefill_attention(q, k, v, *args)
    sdpa = reference.paged_prefill_attention(q, k, v, *args)
    assert not torch.equal(kernel, sdpa)
    torch_threads(1)
    assert torch.equal(cpu_ops.paged_prefill_attention(q, k, v, *args), kernel)
    torch_threads(cpu_ops._PREFILL_KERNEL_MAX_THREADS + 1)
    assert torch.equal(cpu_ops.paged_prefill_attention(q, k, v, *args), sdpa)
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert torch.equal(cpu_ops.paged_prefill_attention(q32, k32, v32, *args),
                       reference.paged_prefill_attention(q32, k32, v32, *args))
    with pytest.raises(ValueError, match="bf16"):
        cpu_prefill.paged_prefill_attention(q32, k32, v32, *args)


def test_cpu_prefill_rejects_inputs_it_would_read_past():
    """Heads that do not divide into KV heads, and context lengths the block table cannot
    hold or that are shorter than the new tokens, are errors (not reads past the packed K/V)."""
    q, k, v, table, cu, ctx = _batch([(0, 20), (9, 30)], 64, 2, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_prefill.paged_prefill_attention(q[:, :5], k, v, table, cu, ctx, 0.125)
    too_long = ctx.clone()
    too_long[1] = table.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="sequence 1: context_lens"):
        cpu_prefill.paged_prefill_attention(q, k, v, table, cu, too_long, 0.125)
    with pytest.raises(ValueError, match="sequence 0: context_lens"):
        cpu_prefill.paged_prefill_attention(q, k, v, table, cu, torch.tensor([19, 39], dtype=torch.int32), 0.125)
    with pytest.raises(ValueError, match="bf16"):
        cpu_prefill.paged_prefill_attention(q, k, v.half(), table, cu, ctx, 0.125)
