"""Block keys: the chained hash that names a KV block (Mooncake paper section 3.2).

A block is `block_size` consecutive tokens. Its key hashes the previous block's
key, the block's own token ids and a salt, so two prompts share a key exactly
when they share the whole prefix up to and including that block (and the
salt). Only full blocks have keys; a trailing partial block is never cached.

The engine's prefix cache, the store and the conductor's global index all use
these keys, so this module stays small, pure and fast: blake2b (hashlib,
keyed with the salt) over token ids packed as little-endian uint32; a
100k-token prompt takes a few milliseconds.

A pipeline stage (chunked pipeline parallelism, cluster/cpp/stage_prefix.py) stores only
its layers of a block: `slice_key(key, start, stop)` names that layer slice, an
object of its own in the stage's store, distinct from the full block's key.
"""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Sequence

import numpy as np

KEY_BYTES = 16
"""Length of one block key in bytes (128-bit blake2b digest)."""

SALT_BYTES = 32
"""Length of a salt from `make_salt`, bytes (blake2b keys may be up to 64)."""


def make_salt(model_id: str, block_size: int, kv_dtype: str,
              cache_salt: str | None = None) -> bytes:
    """The salt that keeps blocks of different models, layouts or tenants apart.

    Args:
        model_id: a stable name of the weights (e.g. the GGUF file's name and size
            or a digest); blocks of different weights must never share keys.
        block_size: tokens per block (>= 1).
        kv_dtype: dtype name of the cached K/V, e.g. "float32", "bfloat16".
        cache_salt: optional per-tenant salt (the OpenAI-style `cache_salt`);
            tenants with different salts never share blocks. None and "" are
            the same (no tenant salt).
    Returns:
        `SALT_BYTES` bytes.
    Raises:
        ValueError: block_size < 1 or an empty model_id / kv_dtype.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not model_id or not kv_dtype:
        raise ValueError("model_id and kv_dtype must be non-empty")
    # Length-prefix every field so ("ab", "c") and ("a", "bc") never collide.
    h = hashlib.blake2b(digest_size=SALT_BYTES, person=b"mooncaked-salt")
    for part in (model_id, str(int(block_size)), kv_dtype, cache_salt or ""):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def _pack(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (4 bytes a token)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32)")
        return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    # array.array packs a Python list about 3x faster than numpy does.
    try:
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if packed.itemsize != 4:  # pragma: no cover - exotic platforms
        return np.asarray(token_ids, dtype="<u4").tobytes()
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, salt: bytes,
               parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of a token sequence.

    key[i] = blake2b(key=salt, data = key[i-1] || uint32le(tokens of block i)),
    with key[-1] = `parent` (empty for the start of a sequence).

    Args:
        token_ids: the prompt (or prompt + output) token ids, ints in [0, 2**32);
            a list, tuple, array or 1-D numpy array.
        block_size: tokens per block (>= 1); only the first
            `len(token_ids) // block_size` blocks get keys.
        salt: from `make_salt` (1..64 bytes).
        parent: key of the block before token_ids[0], to continue a chain
            (e.g. keys of newly completed blocks of a running request).
    Returns:
        One `KEY_BYTES`-byte key per full block, in order.
    Raises:
        ValueError: block_size < 1, a bad salt length, or a token id out of range.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 1 <= len(salt) <= 64:
        raise ValueError(f"salt must be 1..64 bytes, got {len(salt)}")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    data = memoryview(_pack(token_ids[: n_full * block_size]))
    step = block_size * 4
    base = hashlib.blake2b(key=salt, digest_size=KEY_BYTES)
    keys: list[bytes] = []
    prev = parent
    for off in range(0, n_full * step, step):
        h = base.copy()
        h.update(prev)
        h.update(data[off: off + step])
        prev = h.digest()
        keys.append(prev)
    return keys


def slice_key(key: bytes, start: int, stop: int) -> bytes:
    """The store key of layers [start, stop) of block `key` (a CPP stage's slice).

    A block is layer-major, so layers start..stop are one contiguous byte range of it,
    `[start * L, stop * L)` with L the bytes of one layer's K and V for the block; a
    stage stores that range under this key. Distinct from `key` itself and from any
    other range's key (blake2b over key || uint32le(start) || uint32le(stop), its own
    personalization), `KEY_BYTES` long like a block key.

    Raises: ValueError for an empty key or a range that is not 0 <= start < stop < 2**32.
    """
    if not key:
        raise ValueError("slice_key needs a block key")
    if not 0 <= start < stop < 1 << 32:
        raise ValueError(f"layer range must be 0 <= start < stop, got [{start}, {stop})")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"mooncaked-slice")
    h.update(key)
    h.update(start.to_bytes(4, "little"))
    h.update(stop.to_bytes(4, "little"))
    return h.digest()
