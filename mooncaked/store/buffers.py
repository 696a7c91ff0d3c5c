"""What the store accepts as a block and as a key: zero-copy byte views and argument checks.

Buffers (`src`, `dst`) are anything exposing the buffer protocol (bytes,
bytearray, memoryview, numpy arrays) or CPU torch tensors, C-contiguous, of
exactly `block_bytes` bytes. Keys are 1..MAX_KEY_BYTES bytes (the SSD header's
key field).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .ssd import MAX_KEY_BYTES


def as_u8(buf: Any, writable: bool = False) -> np.ndarray:
    """A flat uint8 numpy view of `buf` (no copy).

    Accepts bytes-like objects, numpy arrays and CPU torch tensors.
    Raises: ValueError for a non-contiguous or (if `writable`) read-only buffer;
        TypeError for a tensor not on the CPU.
    """
    if isinstance(buf, np.ndarray):
        arr = buf
    elif hasattr(buf, "is_contiguous") and hasattr(buf, "numpy"):  # torch.Tensor
        if buf.device.type != "cpu":
            raise TypeError(f"store buffers must be in CPU memory, got a {buf.device} tensor")
        if not buf.is_contiguous():
            raise ValueError("store buffers must be contiguous")
        # Reinterpret as bytes first: numpy has no bfloat16.
        arr = buf.detach().reshape(-1).view(torch_uint8(buf)).numpy()
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("store buffers must be C-contiguous")
    arr = arr.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("destination buffer is read-only")
    return arr


def torch_uint8(tensor: Any) -> Any:
    """torch.uint8, taken from the tensor's own module (torch stays an optional import)."""
    return sys.modules[type(tensor).__module__.split(".")[0]].uint8


def block_view(buf: Any, block_bytes: int, writable: bool = False) -> np.ndarray:
    """`as_u8(buf, writable)`, checked to be exactly `block_bytes` bytes long.
    Raises: ValueError for a wrong length (or what `as_u8` raises)."""
    arr = as_u8(buf, writable)
    if arr.nbytes != block_bytes:
        raise ValueError(f"a block is {block_bytes} bytes, got a buffer of {arr.nbytes}")
    return arr


def check_key(key: bytes) -> None:
    """Raises ValueError unless `key` is bytes of 1..MAX_KEY_BYTES (24) bytes."""
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block key is 1..{MAX_KEY_BYTES} bytes, got {key!r:.40}")
