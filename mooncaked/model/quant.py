"""Quantized linear weights kept quantized: GGUF Q4_0/Q4_1 as packed int4, Q8_0 as int8.

The GGUF loader (weights.py, `keep_quantized=True`) hands over Q4_0, Q4_1 and Q8_0
tensors as `QuantizedWeight` (the file's raw blocks); `make_linear` turns them
into a `Linear` that runs torch's CPU weight-only kernels:

- Q4_0 / Q4_1 (blocks of 32: fp16 d [and m], 16 bytes of nibbles) -> int4 packed
  by `aten._convert_weight_to_int4pack_for_cpu`, group size 32, run by
  `aten._weight_int4pack_mm_for_cpu`, whose weight is (q - 8) * scale + zero.
  Q4_0: w = (q - 8) * d, so scale = d, zero = 0. Q4_1: w = d * q + m =
  (q - 8) * d + (m + 8 d), so scale = d, zero = m + 8 d. Exact up to storing
  scale and zero in the activation dtype (bf16: 8 mantissa bits, the file: fp16).
- Q8_0 (blocks of 32: fp16 d, 32 int8) -> int8 with one scale per row for
  `aten._weight_int8pack_mm` (it takes per-row scales only): the block values are
  dequantized and requantized per row (round to nearest, symmetric), which is lossy;
  tests/test_quant.py measures the error.
- Anything else (and safetensors weights) stays dense, or with `weight_format =
  "int8"` is quantized to int8 per row on load.

Measured here (one thread, bf16, 576x3072 gate/up): the int4 kernel reads the
weight at batch 1 in 45 us against 185 us for the dense bf16 matmul, but at 32
rows it takes 740 us against 389 us, and with fp32 activations it is 20-70x
slower than dense (no fast fp32 path in torch's CPU kernel). So `Linear` keeps a
dense copy for steps of more than `dense_above` tokens (prefill, large decode
batches), and the engine uses quantized weights only with bf16 activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # elements per GGUF Q4/Q8 block, and the int4 kernel's group size
# GGML type ids (gguf.GGMLQuantizationType) of the formats we keep quantized.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
KEPT_TYPES = frozenset(_BLOCK_BYTES)
WEIGHT_FORMATS = ("auto", "dequantized", "int8")


@dataclass
class QuantizedWeight:
    """A GGUF tensor's raw blocks: uint8 [rows, rows_bytes] of `qtype` for a [rows, cols] matrix."""

    qtype: int
    data: np.ndarray
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols] (the values llama.cpp computes with)."""
        rows, cols = self.shape
        blocks = self.data.reshape(rows, cols // GROUP, _BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
        if self.qtype == Q8_0:
            q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
            return torch.from_numpy((q * d).reshape(rows, cols))
        q = _nibbles(blocks[..., 4:] if self.qtype == Q4_1 else blocks[..., 2:]).astype(np.float32)
        if self.qtype == Q4_0:
            w = (q - 8) * d
        else:
            m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
            w = q * d + m
        return torch.from_numpy(w.reshape(rows, cols))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] uint8 values: low nibbles first (GGML's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


class Linear:
    """y = x @ W.T for one weight, dense or weight-only quantized. Call with x [T, in] ->
    [T, out], x's dtype. `weight` is the dense matrix (None where not kept)."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor | None):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        """Bytes this weight keeps in memory."""
        return self.weight.numel() * self.weight.element_size() if self.weight is not None else 0


class Int4Linear(Linear):
    """GGUF Q4_0/Q4_1 as packed int4, group 32 (`_weight_int4pack_mm_for_cpu`).

    x: [T, in] bf16 -> [T, out]; steps of more than `dense_above` tokens use the dense copy.
    """

    kind = "int4"

    def __init__(self, parts: list[QuantizedWeight], dtype: torch.dtype, dense_above: int | None):
        qs, szs = [], []
        for p in parts:
            rows, cols = p.shape
            blocks = p.data.reshape(rows, cols // GROUP, _BLOCK_BYTES[p.qtype])
            d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]  # [rows, nb]
            if p.qtype == Q4_1:
                m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
                zero, nib = m + 8 * d, blocks[..., 4:]
            else:
                zero, nib = np.zeros_like(d), blocks[..., 2:]
            qs.append(_nibbles(nib).reshape(rows, cols))
            szs.append(np.stack([d, zero], -1))  # [rows, nb, 2]
        q = torch.from_numpy(np.concatenate(qs, 0).astype(np.int32))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)  # uint8 [out, in/2]
        sz = torch.from_numpy(np.concatenate(szs, 0))  # fp32 [out, nb, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(dtype)  # [in/32, out, 2]
        self.dense_above = dense_above
        dense = None
        if dense_above is not None:
            dense = torch.cat([p.dequantize() for p in parts], 0).to(dtype).contiguous()
        super().__init__(dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.shape[0] > self.dense_above:
            return F.linear(x, self.weight)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def nbytes(self) -> int:
        return (super().nbytes() + self.packed.numel()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())


class Int8Linear(Linear):
    """int8 with one scale per output row (`_weight_int8pack_mm`), from Q8_0 or dense weights.

    Rows are requantized symmetric: scale = max|w_row| / 127, q = round(w / scale).
    x: [T, in] bf16 -> [T, out]; steps of more than `dense_above` tokens use the dense copy.
    `rows(ids)` dequantizes rows (the embedding lookup of a tied LM head).
    """

    kind = "int8"

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, dense_above: int | None):
        w = w.float()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
        self.q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(dtype)
        self.dense_above = dense_above
        super().__init__(w.to(dtype).contiguous() if dense_above is not None else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.shape[0] > self.dense_above:
            return F.linear(x, self.weight)
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows [len(ids), in], the scales' dtype."""
        return self.q[ids].to(self.scales.dtype) * self.scales[ids, None]

    def nbytes(self) -> int:
        return super().nbytes() + self.q.numel() + self.scales.numel() * self.scales.element_size()


class Bf16Linear(Linear):
    """A dense fp32 model's projection run in bf16 for prompt rows (`dtype = auto` on a CPU
    with AVX512-BF16, model/numerics.py): x [T, in] fp32 -> [T, out] fp32, computed as
    bf16 x bf16 (torch's oneDNN matmul: `vdpbf16ps`, fp32 sums) and rounded to bf16 on the
    way out. Keeps only the bf16 weight [out, in] (half the fp32 copy's bytes).

    Measured (AMD EPYC Zen 4, one thread, bundled model): a 1,000-token prefill 2.91 ->
    1.83 s; max |logit error| 0.6-0.7 against the fp32 forward, no greedy pick changed
    where the top-2 gap exceeds 0.5 (tests/test_numerics.py bounds it).
    """

    kind = "bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.to(torch.bfloat16).contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


class Int8ActLinear(Linear):
    """A dense fp32 model's projection run for prompt rows over the GGUF's own Q4_0/Q4_1
    blocks with int8 activations (`dtype = auto` on AVX2 and on AVX-512 without bf16,
    model/numerics.py): x [T, in] fp32 -> [T, out] fp32 by kernels/cpu_gemm.py's GEMM (the
    activations rounded to int8 per block of 32, as the fused decode step and llama.cpp
    round them; the weights exact). Keeps only the repacked codes and fp32 scales (1.25 bytes
    a weight against 4 for the fp32 copy); `weight` is None.

    Args:
        packed: the cpu_gemm.PackedWeight [out, in].
        gemm: cpu_gemm.gemm (passed in: this module does not import the Numba kernels).
    """

    kind = "int8-activations"

    def __init__(self, packed, gemm):
        super().__init__(None)
        self.packed, self._gemm = packed, gemm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._gemm(self.packed, x.detach().contiguous().numpy(), torch.get_num_threads())
        return torch.from_numpy(y)

    def nbytes(self) -> int:
        """Bytes this weight keeps in memory."""
        return self.packed.nbytes()


def bf16_rows_invariant(shapes: set[tuple[int, int]], min_rows: int, seed: int = 0) -> bool:
    """Whether torch's bf16 matmul on this CPU gives a row the same bits in any batch of at
    least `min_rows` rows, for weights of each (out, in) shape: rows computed in batches of
    several sizes and offsets against the same rows of one 512-row product.

    Checked once at start-up (a few ms): a dense fp32 model with the fused decode step
    promises prompt K/V independent of the chunking (LlamaModel.row_invariant); the
    oneDNN kernel torch picks (AVX512-BF16, AMX) is not ours, so the promise is measured
    on the machine rather than assumed. Measured row-invariant on AMD EPYC Zen 4 from 2
    rows up.
    """
    gen = torch.Generator().manual_seed(seed)
    sizes = [(0, min_rows), (3, min_rows + 1), (min_rows, 2 * min_rows + 5), (7, 100), (100, 300), (0, 512)]
    for out, cols in sorted(shapes):
        w = torch.randn(out, cols, generator=gen).to(torch.bfloat16)
        x = torch.randn(512, cols, generator=gen).to(torch.bfloat16)
        whole = F.linear(x, w)
        for start, stop in sizes:
            if not torch.equal(F.linear(x[start:stop], w), whole[start:stop]):
                return False
    return True


def dense(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """fp32 (or the tensor's own dtype) dense matrix of a tensor or a QuantizedWeight."""
    return t.dequantize() if isinstance(t, QuantizedWeight) else t


def quantized_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weight-only quantized kernels pay off: bf16 activations on the CPU (the
    fp32 path of torch's CPU int4/int8 kernels is 20-70x slower than dense, measured)."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def make_linear(parts: list[torch.Tensor | QuantizedWeight], fmt: str, dtype: torch.dtype,
                device: torch.device, dense_above: int | None) -> Linear:
    """One Linear from row blocks stacked in order (e.g. [wq, wk, wv] -> fused QKV).

    Args:
        parts: [out_i, in] each, dense tensors or QuantizedWeights.
        fmt: "auto" (keep the file's quantization: Q4_0/Q4_1 -> int4, Q8_0 -> int8; dense
            stays dense), "dequantized" (all dense) or "int8" (all int8 per row).
        dtype, device: activation dtype and device; quantized kernels are used only where
            `quantized_ok` holds, otherwise the weight is dequantized.
        dense_above: keep a dense copy too and use it for steps of more than this many
            tokens; None keeps no copy (quantized for every step).
    Raises: ValueError for an unknown fmt.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, not {fmt!r}")
    if fmt != "dequantized" and quantized_ok(dtype, device):
        types = {p.qtype if isinstance(p, QuantizedWeight) else None for p in parts}
        if fmt == "auto" and types <= {Q4_0, Q4_1}:
            return Int4Linear(parts, dtype, dense_above)
        if fmt == "int8" or types == {Q8_0}:
            return Int8Linear(torch.cat([dense(p) for p in parts], 0), dtype, dense_above)
    w = torch.cat([dense(p) for p in parts], 0) if len(parts) > 1 else dense(parts[0])
    return Linear(w.to(device=device, dtype=dtype).contiguous())
