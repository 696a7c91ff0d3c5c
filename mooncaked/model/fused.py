"""Glue between LlamaModel and the fused CPU decode step (kernels/cpu_fused_decode.py).

`why_not` decides whether a model can run the fused step (and says why not),
`build` turns the loader's QuantizedWeights into the step's stacked GGUF blocks,
`decode` and `logits` run it for a decode step. The fused step needs: the GGUF's
Q4_0/Q4_1 linear weights (`weight_format = auto`), the CPU with a bf16 or fp32 model
dtype (its activations are fp32 either way; the KV cache, the model's dtype, is read
and written as it is), every matmul width a multiple of 64, the whole model (not a
pipeline stage), the CPU kernel set (attention_backend auto or cpu), and a CPU whose
ISA level runs one of cpu_gemv's compiled variants: AVX2+FMA or AVX-512 VNNI, chosen
at build (kernels/cpu_isa.py; MOONCAKED_CPU_ISA caps it).

`prompt_gemm_why_not` and `prompt_linears` do the same for the prompt rows' projections
over the same blocks (kernels/cpu_gemm.py, int8 activations; `dtype = auto` on AVX2 /
AVX-512 VNNI): Q4_0/Q4_1 weights and a CPU with AVX2+FMA, in a whole model or a stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mooncaked.kernels import cpu_isa

from . import quant
from .weights import ModelConfig

if TYPE_CHECKING:
    from .llama import AttentionMetadata, LlamaModel

_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _gemv_weight(t: quant.QuantizedWeight):
    from mooncaked.kernels.cpu_gemv import BLOCK, GemvWeight  # noqa: PLC0415 - needs numba
    rows, cols = t.shape
    return GemvWeight.from_blocks(t.qtype, t.data.reshape(rows, cols // BLOCK, -1))


def why_not(cfg: ModelConfig, tensors: dict, weight_format: str, dtype: torch.dtype,
            device: torch.device, ops, partial: bool) -> str | None:
    """None when the fused decode step can run this model, else the reason it cannot."""
    if partial:
        return "a pipeline stage (a layer range)"
    if weight_format != "auto" or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return (f"needs weight_format = auto (the GGUF's Q4 blocks) on the CPU with dtype bfloat16 "
                f"or float32, not {weight_format} on {device.type} with {str(dtype).removeprefix('torch.')}")
    if not getattr(ops, "__name__", "").endswith("cpu_ops"):
        return "needs the CPU kernel set (engine.attention_backend auto or cpu)"
    try:
        from mooncaked.kernels import cpu_gemv  # noqa: PLC0415 - needs numba
    except ImportError as e:
        return f"Numba kernels unavailable: {e}"
    if not cpu_gemv.supported():
        return (f"needs a CPU with AVX2+FMA or AVX-512 VNNI; this one runs ISA level {cpu_isa.isa_level()} "
                f"({cpu_isa.cpu_name()})")
    for k, v in tensors.items():
        if k.startswith("layers.") and k.split(".", 2)[2] in _LINEARS:
            if not isinstance(v, quant.QuantizedWeight) or v.qtype not in (quant.Q4_0, quant.Q4_1):
                return f"{k} is not Q4_0/Q4_1"
            if v.shape[1] % 64:
                return f"{k} has {v.shape[1]} columns (not a multiple of 64)"
    head = tensors.get("lm_head", tensors.get("embed"))
    if not isinstance(head, quant.QuantizedWeight) or head.shape[1] % 64:
        return "the LM head is not a GGUF Q4_0/Q4_1/Q8_0 matrix"
    if cfg.head_dim % 16:
        return "head_dim not a multiple of 16 (cpu_decode's rows are whole vectors)"
    return None


def build(cfg: ModelConfig, tensors: dict, rope_cos: np.ndarray, rope_sin: np.ndarray):
    """The model's cpu_fused_decode.FusedWeights (check `why_not` first), on the GEMV
    variant this CPU runs (cpu_gemv.variant()); rope_cos, rope_sin: the model's rotary
    tables, fp32 [P, head_dim / 2]."""
    from mooncaked.kernels.cpu_fused_decode import FusedWeights  # noqa: PLC0415 - needs numba
    from mooncaked.kernels.cpu_gemv import GemvWeight, variant  # noqa: PLC0415 - needs numba
    layers, attn_norm, mlp_norm = [], [], []
    for i in range(cfg.num_layers):
        t = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
        g = {k: _gemv_weight(t[k]) for k in _LINEARS}
        layers.append({"qkv": GemvWeight.stack([g["wq"], g["wk"], g["wv"]]), "o": g["wo"],
                       "gate_up": GemvWeight.stack([g["w_gate"], g["w_up"]]), "down": g["w_down"]})
        attn_norm.append(quant.dense(t["attn_norm"]).float().numpy())
        mlp_norm.append(quant.dense(t["mlp_norm"]).float().numpy())
    head = _gemv_weight(tensors.get("lm_head", tensors.get("embed")))
    return FusedWeights.stack(layers, attn_norm, mlp_norm, rope_cos, rope_sin, head,
                              quant.dense(tensors["norm"]).float().numpy(), variant())


def decode(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor,
           meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
    """LlamaModel.forward for a decode step through the fused kernels: fp32 [T, hidden]."""
    from mooncaked.kernels.cpu_fused_decode import decode_layers  # noqa: PLC0415 - needs numba
    ids = input_ids.numpy()
    if model.embed is not None:
        h = model.embed[input_ids].float().numpy().copy()
    else:  # a tied head: its GGUF rows, exactly as the file holds them
        h = model.fused.head.rows(ids)
    cfg = model.cfg
    h = np.ascontiguousarray(h, np.float32)
    decode_layers(model.fused, h, positions, meta.slot_mapping,
                  meta.decode_block_tables, meta.decode_context_lens, kv_cache, cfg.num_heads,
                  cfg.num_kv_heads, cfg.rms_norm_eps, model.scale)
    return torch.from_numpy(h)


def logits(model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaModel.logits of the fused step's fp32 hidden states: fp32 [N, vocab]."""
    from mooncaked.kernels.cpu_fused_decode import head_logits  # noqa: PLC0415 - needs numba
    return head_logits(model.fused, hidden.numpy(), model.cfg.rms_norm_eps)


_PROMPT_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
                       "w_down": ("w_down",)}


def prompt_gemm_why_not(tensors: dict, layers: range) -> str | None:
    """None when the layers' projections can run prompt rows through kernels/cpu_gemm.py
    (int8 activations over the GGUF's Q4 blocks), else the reason they cannot."""
    try:
        from mooncaked.kernels import cpu_gemm  # noqa: PLC0415 - needs numba
    except ImportError as e:
        return f"Numba kernels unavailable: {e}"
    if not cpu_gemm.supported():
        return f"needs a CPU with AVX2+FMA; this one runs ISA level {cpu_isa.isa_level()}"
    for i in layers:
        for name in _LINEARS:
            v = tensors.get(f"layers.{i}.{name}")
            if not isinstance(v, quant.QuantizedWeight) or v.qtype not in (quant.Q4_0, quant.Q4_1):
                return f"layers.{i}.{name} is not Q4_0/Q4_1"
            if v.shape[0] % cpu_gemm.COLS or v.shape[1] % 64:
                return f"layers.{i}.{name} is {list(v.shape)} (rows a multiple of 8, columns of 64)"
    return None


def prompt_linears(tensors: dict, layer: int) -> dict[str, quant.Linear]:
    """Layer `layer`'s four projections (wqkv, wo, w_gate_up, w_down) as quant.Int8ActLinear
    over the file's blocks (check `prompt_gemm_why_not` first)."""
    from mooncaked.kernels.cpu_gemm import PackedWeight, gemm  # noqa: PLC0415 - needs numba
    from mooncaked.kernels.cpu_gemv import GemvWeight  # noqa: PLC0415 - needs numba
    out = {}
    for key, parts in _PROMPT_PROJECTIONS.items():
        g = GemvWeight.stack([_gemv_weight(tensors[f"layers.{layer}.{p}"]) for p in parts])
        out[key] = quant.Int8ActLinear(PackedWeight.from_gemv(g), gemm)
    return out
