"""kernels/cpu_gemm.py, the prompt GEMM (Q4 codes x int8 activations, AVX2), against its
contract cpu_gemv.gemv_reference: the same int8 activations, the weights exact, only the
fp32 summation order differs. A row's result must not depend on the batch it came in nor
on the thread split (the row-invariant prompt path, model/llama.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mooncaked.kernels import cpu_gemm, cpu_gemv
from mooncaked.kernels.cpu_gemv import GemvWeight

pytestmark = pytest.mark.cpu_isa("avx2")

REL_ERR = 1e-5   # of the largest |output|: fp32 summation order only (measured <= 8e-7)


def _blocks(rows: int, cols: int, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks [rows, cols / 32, bytes]: Q4_1 (fp16 d, fp16 m, 16 bytes of
    nibbles) or Q4_0 (fp16 d, 16 bytes)."""
    nb = cols // 32
    d = (rng.random((rows, nb)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    codes = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    if qtype == 2:
        return np.concatenate([d, codes], axis=2)
    m = (-rng.random((rows, nb)) * 0.1).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return np.concatenate([d, m, codes], axis=2)


@pytest.mark.parametrize("qtype", [2, 3], ids=["q4_0", "q4_1"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (40, 64)])
def test_gemm_matches_the_reference_in_any_batch_and_split(qtype, shape):
    rng = np.random.default_rng(qtype * 100 + shape[0])
    w = GemvWeight.from_blocks(qtype, _blocks(*shape, qtype, rng))
    packed = cpu_gemm.PackedWeight.from_gemv(w)
    x = rng.standard_normal((203, shape[1])).astype(np.float32)
    x[5] = 0.0                                          # an all-zero row (dx = 0)
    x[7, :32] *= 100                                    # an outlier block
    y = cpu_gemm.gemm(packed, x)
    ref = cpu_gemv.gemv_reference(w, x)
    assert y.shape == (203, shape[0]) and y.dtype == np.float32
    assert np.abs(y - ref).max() <= REL_ERR * np.abs(ref).max()
    assert np.array_equal(y[5], ref[5])                 # the zero row: exactly the m-free sums
    # the same bits for each row alone, in uneven batches and over two threads
    batches = np.concatenate([cpu_gemm.gemm(packed, x[a:b]) for a, b in [(0, 1), (1, 6), (6, 103), (103, 203)]])
    assert np.array_equal(batches, y)
    assert np.array_equal(cpu_gemm.gemm(packed, x, threads=2), y)


def test_packing_rejects_what_the_kernel_cannot_take():
    rng = np.random.default_rng(0)
    q8 = GemvWeight.from_blocks(8, np.concatenate(
        [np.ones((16, 2, 2), np.uint8), rng.integers(0, 256, (16, 2, 32), dtype=np.uint8)], axis=2))
    with pytest.raises(ValueError, match="4-bit"):
        cpu_gemm.PackedWeight.from_gemv(q8)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_gemm.PackedWeight.from_gemv(GemvWeight.from_blocks(3, _blocks(12, 64, 3, rng)))
    packed = cpu_gemm.PackedWeight.from_gemv(GemvWeight.from_blocks(3, _blocks(16, 64, 3, rng)))
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        cpu_gemm.gemm(packed, np.zeros((3, 32), np.float32))
    assert packed.nbytes() == 16 * 64 + 2 * 16 * 2 * 4
