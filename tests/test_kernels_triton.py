"""Triton kernels against their torch references (kernels/reference.py).

By default the kernels run under the Triton interpreter on the CPU
(TRITON_INTERPRET=1, set only while triton is imported and while this module's
tests run, so it does not leak into other tests or the processes they start). With
MOONCAKED_KERNEL_TEST_DEVICE=cuda the same comparisons run compiled on a GPU,
bf16 `tl.dot` included, plus a few larger shapes (benchmarks/gpu_check.sh).

Tolerances (max |triton - reference| <= atol + rtol * |reference|; the reference
computes in fp32 from the same low-precision inputs, so the gap is the output
rounding plus the probabilities' cast to the input dtype before P @ V):
    fp32: 2e-5 / 2e-5   fp16: 5e-3 / 5e-3   bf16: 4e-2 / 2e-2
Copies (write_kv, gather, scatter) must match exactly.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEVICE = os.environ.get("MOONCAKED_KERNEL_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
if ON_GPU and not torch.cuda.is_available():
    raise RuntimeError("MOONCAKED_KERNEL_TEST_DEVICE=cuda but torch sees no CUDA device")


def _import_triton_interpreted() -> bool:
    """Imports triton with TRITON_INTERPRET=1 (its own jit'd helpers such as tl.zeros are
    decorated at import), then restores the environment. False if this process already
    imported triton compiled, in which case the tests rerun in a subprocess."""
    if "triton" in sys.modules:
        import triton.language as tl
        return type(tl.zeros).__name__ == "InterpretedFunction"
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        import triton.language  # noqa: F401
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
    return True


IN_PROCESS = ON_GPU or _import_triton_interpreted()
pytest.importorskip("triton")

from mooncaked.kernels import attention_ops, reference  # noqa: E402

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 2e-2)}
_MODULES = ("triton_util", "triton_decode", "triton_prefill", "triton_copy", "triton_ops")


@pytest.fixture(scope="module")
def ops():
    """kernels.triton_ops, interpreted on the CPU unless the test device is CUDA.

    On the CPU, TRITON_INTERPRET=1 stays set while this module's tests run (the
    interpreter reads it at call time too) and is restored afterwards.
    """
    if ON_GPU:
        # The fp32 references must not use TF32 (torch's default is off; make sure).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        yield importlib.import_module("mooncaked.kernels.triton_ops")
        return
    if not IN_PROCESS:
        pytest.skip("triton was imported compiled in this process; see test_in_fresh_interpreter_process")
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        names = [f"mooncaked.kernels.{m}" for m in _MODULES]
        if any(n in sys.modules for n in names):  # imported compiled elsewhere: redo under the interpreter
            for n in names:
                importlib.reload(importlib.import_module(n))
        mod = importlib.import_module("mooncaked.kernels.triton_ops")
        from mooncaked.kernels.triton_util import interpreting  # noqa: PLC0415
        assert interpreting(sys.modules["mooncaked.kernels.triton_decode"]._decode_kernel)
        yield mod
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _pool(num_blocks, block_size, kv_heads, head_dim, dtype, layers=2, seed=0):
    """A multi-layer paged pool and layer 1's K/V views (strided, as the engine passes them)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    return kv, kv[:, layers - 1, 0], kv[:, layers - 1, 1]


def _tables(lens, block_size, num_blocks, seed=0):
    """Block tables whose blocks are scattered through the pool; unused entries are -1."""
    need = [-(-n // block_size) for n in lens]
    width = max(need)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1))
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n].int()
        used += n
    assert used <= num_blocks
    return table.to(DEVICE)


# (dtype, head_dim, block_size, kv_heads, group, context lengths): context 1, exactly on a
# block boundary, one past it, and mixed lengths in each batch.
DECODE_CASES = [
    (torch.float32, 64, 16, 2, 4, [1, 16, 17, 47]),
    (torch.float16, 80, 32, 1, 8, [33, 1, 64, 95]),
    (torch.bfloat16, 96, 128, 2, 1, [129, 1, 128]),
    (torch.float16, 128, 64, 2, 2, [65, 200, 64]),
]
if ON_GPU:  # long contexts, the auto split heuristic with real tiles, native bf16 dots
    DECODE_CASES += [(torch.bfloat16, 128, 16, 8, 4, [4097, 1, 8191, 16]),
                     (torch.float16, 64, 32, 3, 3, [32768, 5000]),
                     (torch.bfloat16, 80, 16, 2, 7, [3000, 17])]


@pytest.mark.parametrize("dtype,head_dim,block_size,kv_heads,group,lens", DECODE_CASES,
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, list) else "lens")
def test_decode_matches_reference(ops, dtype, head_dim, block_size, kv_heads, group, lens):
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    _, k_cache, v_cache = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    table = _tables(lens, block_size, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    ref = reference.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale)
    # None: the heuristic's choice; 1: one pass; 3: flash-decoding split + merge kernel.
    for splits in (None, 1, 3):
        _close(ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, num_splits=splits), ref, dtype)
    # A tile other than the built-in one (the benchmark's tile sweep), split in two.
    _close(ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, num_splits=2,
                                      tile_config=(16, 4, 1)), ref, dtype)


@pytest.mark.gpu(not ON_GPU, reason="CUDA graphs need a GPU (benchmarks/gpu_check.sh)")
def test_decode_replays_in_cuda_graph(ops):
    """The decode call (split kernel + merge) captured once, replayed on new queries: no host
    sync or host-side state inside, as a serving engine's CUDA-graph decode step needs."""
    dtype, head_dim, block_size, kv_heads, group, lens = torch.bfloat16, 128, 16, 8, 4, [5000, 1, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    _, k_cache, v_cache = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    table = _tables(lens, block_size, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, reference.paged_decode_attention(q, k_cache, v_cache, table, ctx, scale), dtype)


# (dtype, head_dim, block_size, kv_heads, group, [(context length, new tokens)]):
# context 1; a fresh prompt exactly one block long; fully cached except its last token;
# a cached prefix ending mid-block with new tokens crossing block boundaries; a fresh prompt.
PREFILL_CASES = [
    (torch.float32, 64, 16, 2, 2, [(1, 1), (16, 16), (17, 1), (45, 20), (33, 33)]),
    (torch.float16, 80, 32, 1, 4, [(64, 1), (70, 40), (1, 1), (32, 32)]),
    (torch.bfloat16, 128, 64, 2, 1, [(65, 65), (129, 1), (100, 37)]),
    (torch.float16, 96, 128, 1, 2, [(130, 3), (128, 128)]),
]
if ON_GPU:
    PREFILL_CASES += [(torch.bfloat16, 128, 16, 8, 4, [(3000, 1000), (1, 1), (2048, 2048), (4097, 1)]),
                      (torch.float16, 96, 128, 4, 2, [(1500, 700), (300, 300)]),
                      (torch.float32, 64, 16, 2, 3, [(700, 200), (129, 129)])]


@pytest.mark.parametrize("dtype,head_dim,block_size,kv_heads,group,spec", PREFILL_CASES,
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, list) else "spec")
def test_prefill_matches_reference(ops, dtype, head_dim, block_size, kv_heads, group, spec):
    lens = [c for c, _ in spec]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    _, k_cache, v_cache = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    table = _tables(lens, block_size, num_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + torch.tensor([n for _, n in spec]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale)
    _close(ops.paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_matches_reference(ops, dtype):
    kv_heads, head_dim, block_size = 3, 80, 16
    kv_ref, kc_ref, vc_ref = _pool(12, block_size, kv_heads, head_dim, dtype)
    kv_out = kv_ref.clone()
    kc_out, vc_out = kv_out[:, 1, 0], kv_out[:, 1, 1]
    # K and V as strided slices of one fused projection output, as a model produces them.
    qkv = torch.randn(6, 3 * kv_heads, head_dim, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    k, v = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]
    slots = torch.tensor([0, 15, 16, -1, 12 * block_size - 1, 100], dtype=torch.int64, device=DEVICE)
    reference.write_kv(k, v, kc_ref, vc_ref, slots)
    ops.write_kv(k, v, kc_out, vc_out, slots)
    assert torch.equal(kv_out, kv_ref)
    assert torch.equal(kv_out[11, 1, 1, 15], v[4])  # the last slot of the pool was written
    assert torch.equal(kv_out[:, 0], kv_ref[:, 0])  # the other layer is untouched


def test_write_kv_rejects_slot_outside_pool(ops):
    _, kc, vc = _pool(2, 16, 1, 64, torch.float16)
    k = torch.zeros(1, 1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(IndexError):
        ops.write_kv(k, k, kc, vc, torch.tensor([32]))


def test_gather_scatter_match_reference(ops):
    kv, _, _ = _pool(9, 16, 2, 96, torch.bfloat16, layers=3)
    ids = torch.tensor([7, 0, 3, 8], device=DEVICE)
    blocks = ops.gather_blocks(kv, ids)
    assert blocks.is_contiguous() and torch.equal(blocks, reference.gather_blocks(kv, ids))
    # Round trip into fresh pages, then a scatter of fp32 blocks cast to the cache's dtype.
    other = torch.zeros_like(kv)
    ops.scatter_blocks(other, torch.tensor([1, 2, 4, 5]), blocks)
    assert torch.equal(other[[1, 2, 4, 5]], kv[[7, 0, 3, 8]]) and not other[[0, 3, 6, 7, 8]].any()
    f32 = torch.randn(2, *kv.shape[1:], generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ref = kv.clone()
    reference.scatter_blocks(ref, torch.tensor([2, 6]), f32)
    ops.scatter_blocks(kv, torch.tensor([2, 6]), f32)
    assert torch.equal(kv, ref)


def test_block_copies_reject_bad_ids(ops):
    kv, _, _ = _pool(4, 16, 1, 64, torch.float16, layers=1)
    with pytest.raises(IndexError):
        ops.gather_blocks(kv, torch.tensor([0, 4]))
    with pytest.raises(IndexError):
        ops.scatter_blocks(kv, torch.tensor([-1]), kv[:1])
    with pytest.raises(ValueError):
        ops.scatter_blocks(kv, torch.tensor([1]), kv[:2])


def test_attention_rejects_mismatched_heads(ops):
    _, kc, vc = _pool(4, 16, 3, 64, torch.float16)
    q = torch.zeros(1, 4, 64, dtype=torch.float16, device=DEVICE)  # 4 heads over 3 KV heads
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_decode_attention(q, kc, vc, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


def test_split_heuristic(ops):
    split = ops.decode_num_splits
    # Enough (sequence, KV head) programs to fill 132 SMs (about 4 per SM): one pass.
    assert split(64, 8, 32768, 132, 64) == (1, 32768)
    # Short contexts are never split: every split reads at least 128 tokens.
    assert split(1, 8, 255, 132, 64)[0] == 1
    assert split(1, 8, 256, 132, 64) == (2, 128)
    # One long sequence on a big GPU: ~4 programs per SM, capped at 64 splits.
    n, tokens = split(1, 8, 32768, 132, 64)
    assert n == 64 and tokens == 512
    n, tokens = split(1, 8, 8192, 132, 64)
    assert n == 64 and tokens == 128 and n * tokens >= 8192 > (n - 1) * tokens
    # Batch 4: 32 programs -> 16 splits (512 programs); batch 16: 128 programs -> 4 splits.
    assert split(4, 8, 8192, 132, 64) == (16, 512)
    assert split(16, 8, 16384, 132, 64) == (4, 4096)
    # Splits are whole tiles and cover the context.
    n, tokens = split(3, 5, 10001, 132, 64)
    assert tokens % 64 == 0 and tokens >= 128 and n * tokens >= 10001 > (n - 1) * tokens


def test_attention_ops_selects_backend():
    from mooncaked.kernels import cpu_ops  # noqa: PLC0415

    assert attention_ops("cpu") is cpu_ops
    assert attention_ops("cpu", "torch") is reference
    assert attention_ops("cuda", "torch") is reference


if not IN_PROCESS:  # defined only where the tests above could not run in this process
    def test_in_fresh_interpreter_process():
        """Reruns this file where triton can still be imported under the interpreter."""
        import subprocess  # noqa: PLC0415

        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_bench_runs_on_tiny_shapes(ops, capsys):
    """The benchmark's code paths (not its timings) on tiny shapes; the GPU run is gpu_check.sh."""
    from mooncaked.kernels import bench  # noqa: PLC0415

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    result = bench.run(torch.device(DEVICE), shape, decode_batches=(2,), decode_contexts=(40,),
                       prefill_cases=((2, 20, 12),), iters=1, gather=(3, 2), ops=ops,
                       decode_sweep=((2, 300),) if ON_GPU else ())
    (dec,), (pre,) = result["decode"], result["prefill"]
    diff = TOL[dtype][0] * 2  # ours vs SDPA: both round their outputs
    assert dec["batch"] == 2 and dec["context"] == 40 and dec["max_abs_diff"] < diff
    assert dec["bytes"] == (2 * 2 * 40 * 2 + 2 * 4) * 64 * dtype.itemsize
    assert pre["flops"] == 4 * 2 * 4 * 64 * (20 * 12 + 20 * 21 // 2) and pre["max_abs_diff"] < diff
    if ON_GPU:  # the sweep point: every tile either timed or its error recorded
        tiles = result["decode_tiles"][0]
        assert set(tiles["pct_of_copy"]) | set(tiles["errors"]) == {
            "/".join(map(str, t)) for t in bench.SWEEP_TILES}
    else:
        assert result["decode_tiles"] == []   # decode_sweep=() on the CPU
    assert result["gather"]["blocks"] == 3 and result["skipped"] == [] and result["errors"] == []
    assert set(result["summary"]) >= {"decode_min_pct_of_copy_at_8k_plus", "decode_faster_than_sdpa_everywhere"}
    bench.render(result)
    printed = capsys.readouterr().out
    assert "decode attention" in printed and "prefill attention" in printed and "gather_blocks" in printed
    assert "summary" in printed and max(map(len, printed.splitlines())) < 200


def test_bench_refuses_without_cuda(capsys, monkeypatch):
    from mooncaked.kernels import bench  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host
    assert bench.main(["--json"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
