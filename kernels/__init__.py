"""Paged-attention kernels: Triton on CUDA, torch references elsewhere (same signatures).

`attention_ops(device, backend)` returns the module whose functions the engine
calls: `write_kv`, `paged_decode_attention`, `paged_prefill_attention`,
`gather_blocks`, `scatter_blocks` (see `reference` for shapes and layout).
"""

from __future__ import annotations

import types

import torch

from . import reference


def attention_ops(device: torch.device | str, backend: str = "auto") -> types.ModuleType:
    """Picks the kernel implementation.

    Args:
        device: where the KV cache lives.
        backend: "auto" (Triton on CUDA, torch references otherwise), "triton" or "torch".
    Returns: a module with the kernel functions.
    Raises: RuntimeError if "triton" is forced but Triton cannot be imported.
    """
    device = torch.device(device)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    try:
        from . import triton_ops  # noqa: PLC0415 - optional, needs triton
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"attention_backend = 'triton' but Triton kernels are unavailable: {e}") from e
        return reference
    return triton_ops
