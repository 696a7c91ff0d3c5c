"""transformers' model of a GGUF file, as a plain Hugging Face checkpoint kept in the load
cache: the baseline of the benchmarks and the oracle of the tests.

`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` parses the GGUF header with
gguf-py (every element of the 49k-token tokenizer arrays) and dequantizes in Python: 25 s
on a quiet two-core AMD EPYC, 60-80 s on a loaded one, every time. Its result depends only
on the file and transformers' version, so the first load here saves it as a checkpoint
directory (config.json and model.safetensors, fp32, the weights exactly as transformers
dequantized them) in mooncaked's load cache (model/load_cache.py), and later loads read
that directory (0.2 s). The two give the same parameters, buffers and logits bit for bit
(checked once by hand, transformers 5.25); tests/test_model_oracle.py checks the saving
round trip and compares the checkpoint's model with ours.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from mooncaked.model import load_cache

WEIGHTS = "model.safetensors"


def checkpoint_dir(gguf: Path) -> Path:
    """A Hugging Face checkpoint directory (config.json, model.safetensors in fp32) holding
    transformers' own reading of GGUF file `gguf`, built on first use (one load through
    gguf_file=, then saved) and found in the load cache after that.

    Without a writable cache the built directory is not kept: the caller gets a
    temporary directory that lives as long as the process (logged by load_cache).
    Raises: OSError when `gguf` is missing; what transformers raises for a file it
    cannot read."""
    import transformers  # noqa: PLC0415 - heavy, loaded only by the commands that need it

    final = load_cache.entry("transformers-checkpoints",
                             load_cache.file_key(gguf, f"transformers {transformers.__version__}"))
    if (final / WEIGHTS).is_file() and (final / "config.json").is_file():
        return final
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    with load_cache.building_dir(final) as build:
        if build is not None:
            save_checkpoint(model, build)
    if (final / WEIGHTS).is_file():
        return final
    fallback = Path(_kept_tmpdir())
    save_checkpoint(model, fallback)
    return fallback


def load_model(gguf: Path, dtype: torch.dtype) -> Any:
    """transformers' causal LM of GGUF file `gguf` in `dtype` (its fp32 dequantized
    weights cast, as from_pretrained(gguf_file=..., dtype=dtype) casts them), eval mode.
    Raises as checkpoint_dir."""
    import transformers  # noqa: PLC0415 - heavy, loaded only by the commands that need it

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir(gguf)), dtype=dtype)
    return model.eval()


def save_checkpoint(model: Any, out: Path) -> None:
    """Writes `model`'s weights and config (without the GGUF quantization entry, which
    makes transformers refuse save_pretrained) as a checkpoint in `out`. A tied output
    head is left out: transformers ties it again from the config on load."""
    from safetensors.torch import save_file  # noqa: PLC0415 - with transformers, see above

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))


_TMPDIRS: list[Any] = []


def _kept_tmpdir() -> str:
    """A temporary directory removed when the process exits."""
    d = tempfile.TemporaryDirectory(prefix="mooncaked-hf-")
    _TMPDIRS.append(d)
    return d.name


__all__ = ["checkpoint_dir", "load_model", "save_checkpoint"]
