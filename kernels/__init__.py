"""Paged-attention kernels: Triton on CUDA, Numba + torch on the CPU (same signatures).

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
        backend: "auto" (Triton on CUDA; on the CPU `cpu_ops`: decode attention reading
            the pages in place with Numba, the rest torch), "triton", "cpu" (cpu_ops) or
            "torch" (the references only).
    Returns: a module with the kernel functions.
    Raises: RuntimeError if "triton" is forced but Triton cannot be imported.
    """
    device = torch.device(device)
    if backend == "torch":
        return reference
    if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
        try:
            from . import cpu_ops  # noqa: PLC0415 - needs numba
        except ImportError as e:
            if backend == "cpu":
                raise RuntimeError(f"attention_backend = 'cpu' but its Numba kernel is unavailable: {e}") from e
            return reference
        return cpu_ops
    try:
        from . import triton_ops  # noqa: PLC0415 - optional, needs triton
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"attention_backend = 'triton' but Triton kernels are unavailable: {e}") from e
        return reference
    return triton_ops
