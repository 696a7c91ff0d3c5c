"""kernels/cpu_decode.py (decode attention reading the pages in place) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import attention_ops, cpu_decode, cpu_fused, cpu_ops, reference


@pytest.mark.parametrize("dtype,hd,group,bs", [(torch.float32, 64, 3, 16), (torch.bfloat16, 64, 3, 16),
                                               (torch.bfloat16, 32, 1, 16), (torch.bfloat16, 128, 4, 16),
                                               (torch.bfloat16, 64, 3, 5), (torch.float32, 64, 2, 32)])
def test_cpu_decode_matches_reference(dtype, hd, group, bs):
    # head_dim and the GQA group are compile-time constants of the kernel. Its tiles are 16
    # tokens: lengths around 16 and block sizes other than 16 (tiles that span pages, pages
    # that hold two tiles) check the tile edges.
    g = torch.Generator().manual_seed(0)
    kv_heads, layers = 3, 2
    lens = [1, 15, 16, 17, 100, 250]
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 5
    cache = torch.randn(num_blocks, layers, 2, bs, kv_heads, hd, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n].int()
        used += n
    q = torch.randn(len(lens), kv_heads * group, hd, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    k, v = cache[:, 1, 0], cache[:, 1, 1]  # strided views of layer 1, as the engine passes them
    got = cpu_decode.paged_decode_attention(q, k, v, table, ctx, 0.125)
    want = reference.paged_decode_attention(q, k, v, table, ctx, 0.125)
    assert got.dtype == dtype and got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def test_cpu_decode_rescales_as_scores_grow():
    """Online softmax: keys that grow along the context move the running max in nearly
    every tile, so each tile rescales what came before; fp32 within 1e-5 of the reference."""
    g = torch.Generator().manual_seed(3)
    bs, kv_heads, hd, group = 16, 3, 64, 3
    lens = [1, 33, 300, 1000]
    need = [-(-n // bs) for n in lens]
    cache = torch.randn(sum(need), 1, 2, bs, kv_heads, hd, generator=g)
    cache[:, 0, 0] *= torch.linspace(0.1, 4, cache.shape[0])[:, None, None, None]
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    table[0, :1], table[1, :3], table[2, :19], table[3, :63] = (torch.arange(a, b, dtype=torch.int32) for a, b in
                                                                ((0, 1), (1, 4), (4, 23), (23, 86)))
    q = torch.randn(len(lens), kv_heads * group, hd, generator=g) * 6
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpu_decode.paged_decode_attention(q, cache[:, 0, 0], cache[:, 0, 1], table, ctx, 0.125)
    want = reference.paged_decode_attention(q, cache[:, 0, 0], cache[:, 0, 1], table, ctx, 0.125)
    assert want.abs().max() > 1.0  # not washed out to a mean of the values
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_backend_selection():
    assert attention_ops("cpu") is cpu_ops
    assert attention_ops("cpu", "cpu") is cpu_ops
    assert attention_ops("cpu", "torch") is reference
    assert cpu_decode.supports(torch.bfloat16) and not cpu_decode.supports(torch.float16)
    assert cpu_decode.supports(torch.float32, 80) and not cpu_decode.supports(torch.bfloat16, 72)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_write_kv_and_rms_norm_match_torch(dtype):
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(12, 2, 2, 16, 3, 64, dtype=dtype)
    want = cache.clone()
    qkv = torch.randn(5, 960, generator=g).to(dtype)  # k, v as the model passes them: strided views
    k, v = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)
    slots = torch.tensor([3, -1, 17, 191, 40], dtype=torch.long)
    cpu_fused.write_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], slots)
    reference.write_kv(k, v, want[:, 1, 0], want[:, 1, 1], slots)
    assert torch.equal(cache, want) and cache.abs().sum() > 0
    x = torch.randn(7, 576, generator=g).to(dtype) * 3
    w = torch.randn(576, generator=g).to(dtype)
    got, ref = cpu_fused.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_cpu_fused_rms_norm_at_prefill_sizes_and_rotary_match_torch():
    """The Numba norm at a prefill's T (no small-T cutoff): bf16 outputs within one bf16
    rounding of torch's (the fp32 sum of squares is reassociated), nearly all equal; the
    in-place rotary: bitwise torch's (the model's complex multiply, one rounding)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1000, 576, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(576, generator=g).to(torch.bfloat16)
    got, ref = cpu_fused.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    assert (got == ref).float().mean() > 0.999
    torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7)
    qkv = torch.randn(300, 960, generator=g).to(torch.bfloat16)
    qk = qkv[:, :768].view(300, 12, 64)  # q and k heads: a strided view, as the model passes it
    positions = torch.randint(0, 4096, (300,), generator=g)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(32, generator=g))
    freqs = torch.polar(torch.ones_like(angles), angles)
    rot = freqs[positions].unsqueeze(1)
    want = torch.view_as_real(torch.view_as_complex(qk.float().reshape(300, 12, 32, 2)) * rot)
    want = want.reshape(300, 12, 64).to(torch.bfloat16)
    before = qkv.clone()
    assert cpu_fused.rotary_(qk, freqs.real.numpy().copy(), freqs.imag.numpy().copy(), positions)
    assert torch.equal(qk, want) and not torch.equal(qk, before[:, :768].view(300, 12, 64))
    assert torch.equal(qkv[:, 768:], before[:, 768:])  # v untouched
    assert not cpu_fused.rotary_(qk.float(), freqs.real.numpy(), freqs.imag.numpy(), positions)
