"""`model.dtype = auto`: the activation/KV dtype and weight format a node runs, chosen once.

`resolve` is the one decision (a pure function of the settings, the device and the CPU's
ISA level, kernels/cpu_isa.py); everything downstream (weight loading, the model, the KV
pages, the store's block-key salt, a P/D handover's dtype check) reads its `Numerics`.

What `auto` picks, and the accuracy it costs (tests/test_numerics.py checks it):

- CPU with AVX2+FMA, AVX-512 VNNI or AVX512-BF16 (``avx2``, ``avx512_vnni``,
  ``avx512_bf16``): float32 activations and KV with the GGUF's blocks kept (prompt
  tokens' projections in bf16 on ``avx512_bf16``, with int8 activations on the others:
  below). (On an AVX512-BF16 CPU, auto was bfloat16 until the suite first ran there: bf16 sums depend
  on the batch, so batched != alone and P/D != one process; `dtype = bfloat16` keeps
  that faster, path-dependent choice for whoever asks for it.) Prompt tokens take the
  dense fp32 path but for those projections (the blocks dequantized, as `dtype =
  float32`), and a prompt's first token the dense fp32 head: `dtype = float32`'s weights and arithmetic, run row-
  invariantly (LlamaModel.row_invariant: other summation orders, logprobs within 1e-4 of
  float32's). Generated tokens take the fused decode step (kernels/cpu_fused_decode.py
  over cpu_gemv's AVX2 / VNNI GEMV: int8 activations quantized per row, as llama.cpp's
  Q8 activations) and its LM head. The split is by token (prompt or generated), never by
  batch: every decode row runs the fused step with the same per-row arithmetic in any
  batch, on a P/D decode node, in a recompute after preemption (ModelRunner.prepare
  replays generated tokens as decode rows), so a token's logits depend only on its
  sequence (batch invariance, P/D = one process, CPP = one node). Accuracy against
  float32: greedy tokens equal where the top-2 gap exceeds 0.5 nats, logits within 1.0
  (tests/test_fused_decode.py; the int8 activations' rounding, 0.07-0.13 in a logprob
  measured on the bundled model).
  On ``avx512_bf16`` the prompt tokens' four layer projections run as bf16 x bf16 matmuls
  (`prompt_dtype`, quant.Bf16Linear; fp32 residual stream, norms, attention, KV and first-
  token head), where the CPU's bf16 matmul is measured row-invariant at start-up (else
  fp32, and the log says why): a cold prefill takes 0.6x the time (AMD EPYC Zen 4, 1,000
  tokens, 2.91 -> 1.83 s) for a prompt logit error of 0.6-0.7 against float32 (greedy
  equal where the top-2 gap exceeds CLEAR_MARGIN, first-token logprob within 0.5:
  tests/test_numerics.py). On ``avx2`` and ``avx512_vnni`` (torch's bf16 matmul is
  emulated there, 5-10x slower than fp32) the prompt tokens' four layer projections run
  with int8 activations over the GGUF's own Q4 blocks (`prompt_dtype` int8,
  quant.Int8ActLinear, kernels/cpu_gemm.py): the activations rounded per block of 32 as
  the generated tokens' are, the weights exact, row-invariant by construction. The
  projections take 0.46-0.51x the time of MKL's fp32 matmul (AMD EPYC Zen 4 compiled for
  AVX2, 1,000 rows, one thread) for a prompt logit error of 1.3-1.7 against float32
  (greedy equal where the top-2 gap exceeds CLEAR_MARGIN, first-token logprob within 0.3:
  tests/test_prompt_int8.py; over 30 chat questions 5 first answer tokens changed, each a
  near tie of fp32 itself, top-2 gap <= 0.11 nats; bf16 projections changed 1). (Per-row W8A8 through one int8 GEMM measured 4-8 logits
  of error: docs/benchmarks.md.) Where the weights are not Q4 blocks, fp32 prompts.
- any other CPU (no AVX2+FMA, ARM): float32, the exact dense path (as `dtype = float32`).
- CUDA: bfloat16 (dense weights; the Triton kernels' native dtype).

`dtype = float32` is the exact option: dense fp32 weights dequantized from the file and
no fused step (its int8 activations round). `dtype = bfloat16` keeps its meaning.
`model.fused_decode_max_batch = 0` turns the fused step off (auto on AVX2 is then the
exact path).

A block key is salted with the resolved dtype (store/keys.py `make_salt`), so a node's
store never mixes KV of different dtypes; nodes of one P/D cluster must resolve to the
same dtype (same CPU kind, or set `model.dtype` explicitly): a node warns when a member's
model dtype differs from its own (cluster/node.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
PROMPT_DTYPES = {**DTYPES, "int8": torch.int8}


@dataclass(frozen=True)
class Numerics:
    """A node's resolved numerics.

    Attributes:
        dtype: "float32" or "bfloat16": activations, norms and KV pages.
        weight_format: "auto" (keep the GGUF's Q4_0/Q4_1/Q8_0 blocks), "dequantized" or
            "int8" (model.weight_format, after `resolve`).
        keep_quantized: load the GGUF's quantized blocks as quant.QuantizedWeight
            (for the quantized linears or the fused decode step) instead of dequantized.
        reason: why, in words (for the start-up log).
        prompt_dtype: the arithmetic of prompt tokens' layer projections ("float32",
            "bfloat16", or "int8": int8 activations over the Q4 blocks; LlamaModel
            `prompt_dtype`, which may still fall back to fp32).
    """

    dtype: str
    weight_format: str
    keep_quantized: bool
    reason: str
    prompt_dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of `dtype`."""
        return DTYPES[self.dtype]

    @property
    def torch_prompt_dtype(self) -> torch.dtype:
        """The torch dtype of `prompt_dtype` (torch.int8 for int8 activations)."""
        return PROMPT_DTYPES[self.prompt_dtype]


def resolve(dtype: str, weight_format: str, device_type: str, isa: str) -> Numerics:
    """The numerics of `model.dtype` / `model.weight_format` on this device and CPU.

    Args:
        dtype: model.dtype: "auto", "float32" or "bfloat16".
        weight_format: model.weight_format: "auto", "dequantized" or "int8".
        device_type: torch device type, "cpu" or "cuda".
        isa: the CPU's ISA level (kernels/cpu_isa.py `isa_level()`: "portable", "avx2",
            "avx512_vnni" or "avx512_bf16"); read only for dtype "auto" on the CPU.
    Returns: the resolved Numerics (dtype never "auto").
    Raises: ValueError for a dtype not in DTYPE_CHOICES.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPE_CHOICES)}, not {dtype!r}")
    cpu = device_type == "cpu"
    if dtype == "float32":
        return Numerics("float32", "dequantized", False,
                        "float32 requested: dense fp32 weights, the exact path")
    if dtype == "bfloat16":
        return Numerics("bfloat16", weight_format, cpu and weight_format != "dequantized",
                        "bfloat16 requested")
    if not cpu:
        return Numerics("bfloat16", weight_format, False, f"auto on {device_type}: bfloat16")
    if isa == "avx512_bf16" and weight_format != "dequantized":
        return Numerics("float32", weight_format, True,
                        f"auto on {isa}: float32, prompt projections in bf16, generated "
                        f"tokens through the fused decode step", prompt_dtype="bfloat16")
    if isa in ("avx2", "avx512_vnni") and weight_format != "dequantized":
        return Numerics("float32", weight_format, True,
                        f"auto on {isa}: float32, prompt projections with int8 activations, "
                        f"generated tokens through the fused decode step", prompt_dtype="int8")
    if isa in ("avx2", "avx512_vnni", "avx512_bf16"):
        return Numerics("float32", weight_format, False,
                        f"auto on {isa}: float32, the exact dense path (weight_format dequantized)")
    return Numerics("float32", "dequantized", False,
                    f"auto on a CPU without AVX2 ({isa}): float32, the exact dense path")
