"""Small helpers shared by the Triton kernels: interpreter detection, padding, launch fallback."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # the exception class moved between Triton releases
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - older Triton
    from triton.runtime.autotuner import OutOfResources  # type: ignore[no-redef]


def interpreting(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs on the CPU in numpy).

    Triton decides this when `@triton.jit` runs, so the kernel object itself is the
    reliable witness, not the current environment.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return max(triton.next_power_of_2(max(int(n), 1)), least)


def dot_in_fp32(kernel: object, dtype: torch.dtype) -> bool:
    """Whether `tl.dot` must run on fp32 operands.

    fp32 inputs: yes, with input_precision="ieee" (no TF32), to match the fp32 reference.
    bf16 under the interpreter: yes, because the interpreter's bf16 `tl.dot` returns
    garbage (seen with triton 3.9.0); on a GPU bf16 dots are native.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting(kernel))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 8 for a CPU (interpreter) device."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# (kernel, compile-time arguments) -> index of the first launch config that fit the device.
_FITS: dict[tuple, int] = {}


def launch(kernel, grid, args: tuple, configs: list[dict], constexprs: dict | None = None) -> None:
    """Launches `kernel[grid](*args, **constexprs, **config)` with the first config that fits.

    The configs go from fastest to safest; a config whose tiles do not fit in shared
    memory raises OutOfResources at compile time, and the next one is tried. Which one
    fit is remembered per (kernel, constexprs), so later calls launch it directly instead
    of recompiling the ones that failed.
    Raises: the last OutOfResources when none fits.
    """
    constexprs = constexprs or {}
    key = (id(kernel), getattr(args[0], "dtype", None), tuple(constexprs.items()))
    first = _FITS.get(key, 0)
    for i in range(first, len(configs)):
        try:
            kernel[grid](*args, **constexprs, **configs[i])
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        if i != first:
            _FITS[key] = i
        return


# Shared by the attention kernels: where a token's K/V row lives in the paged layout.
@triton.jit
def page_rows(bt_row_ptr, tok, tok_mask, BLOCK_SIZE: tl.constexpr):
    """(page ids as int64, offsets in page) of the token positions `tok` of one sequence."""
    page = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    return page, (tok % BLOCK_SIZE).to(tl.int64)
