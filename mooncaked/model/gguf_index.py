"""A GGUF file's header, parsed once: its metadata and its tensor table, cached.

gguf-py's `GGUFReader` parses the whole header, tokenizer arrays included, element by
element: 6-12 s for the bundled model's 49k-token vocabulary on two cores, paid by
every node start and pipeline stage. What the weight loader needs is small: the scalar
metadata (architecture, sizes, rotary settings, special token ids) and, per tensor, its
type, shape and byte range. `read_index` parses the file once with gguf-py, keeps that
as JSON in the load cache (load_cache.py) keyed by the file, and reads the JSON back
next time; tensor bytes are then views of one read-only memory map of the file, as in
gguf-py. The GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import load_cache
from .errors import ModelLoadError

# Metadata arrays longer than this (the tokenizer's tokens, scores, merges) stay out of
# the index: the tokenizer is converted from the file and cached on its own.
MAX_ARRAY_LEN = 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    name: GGUF name (e.g. "blk.0.attn_q.weight"). qtype: GGML type id
    (gguf.GGMLQuantizationType). shape: elements, outermost first ([out, in] for a
    matrix; GGUF stores it reversed). offset, nbytes: its bytes' absolute place in the
    file. item_dtype, item_shape: the NumPy view gguf-py gives its data (float32 [..]
    for F32, uint8 [rows, row bytes] for block-quantized types)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    item_dtype: str
    item_shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFIndex:
    """Metadata (key -> value; strings, numbers, short lists) and tensors of one file."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default` when the file has none."""
        return self.metadata.get(key, default)

    def data(self, t: TensorInfo) -> np.ndarray:
        """Read-only NumPy view of tensor `t`'s bytes (item_dtype, item_shape), mapped
        from the file. Raises ModelLoadError when the file is shorter than its table."""
        mm = _memmap(self.path)
        if t.offset + t.nbytes > mm.size:
            raise ModelLoadError(f"{self.path}: tensor {t.name} runs past the end of the file")
        return mm[t.offset:t.offset + t.nbytes].view(np.dtype(t.item_dtype)).reshape(t.item_shape)


_MAPS: dict[Path, np.memmap] = {}


def _memmap(path: Path) -> np.memmap:
    mm = _MAPS.get(path)
    if mm is None:
        mm = _MAPS[path] = np.memmap(path, dtype=np.uint8, mode="r")
    return mm


def read_index(path: Path) -> GGUFIndex:
    """The index of GGUF file `path`: from the load cache when it holds this file's,
    else parsed with gguf-py (and cached). A cache entry that does not parse is
    rebuilt. Raises ModelLoadError when the file cannot be read as GGUF."""
    try:
        key = load_cache.file_key(path, f"gguf-py {importlib.metadata.version('gguf')}")
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    cached = load_cache.entry("gguf", key + ".json")
    index = _from_json(path, cached)
    if index is None:
        index = _parse(path)
        load_cache.write_file(cached, json.dumps(_to_json(index)).encode())
    return index


def _parse(path: Path) -> GGUFIndex:
    import gguf  # noqa: PLC0415 - heavy import, only when a file is parsed

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    metadata = {}
    for key, f in reader.fields.items():
        if len(f.data) <= MAX_ARRAY_LEN:
            value = f.contents()
            metadata[key] = value.tolist() if isinstance(value, np.ndarray) else value
    tensors = tuple(
        TensorInfo(name=t.name, qtype=int(t.tensor_type), shape=tuple(int(x) for x in reversed(t.shape)),
                   offset=int(t.data_offset), nbytes=int(t.n_bytes), item_dtype=t.data.dtype.str,
                   item_shape=tuple(int(x) for x in t.data.shape))
        for t in reader.tensors)
    return GGUFIndex(path, metadata, tensors)


def _to_json(index: GGUFIndex) -> dict:
    return {"metadata": index.metadata,
            "tensors": [[t.name, t.qtype, t.shape, t.offset, t.nbytes, t.item_dtype, t.item_shape]
                        for t in index.tensors]}


def _from_json(path: Path, cached: Path) -> GGUFIndex | None:
    try:
        raw = json.loads(cached.read_bytes())
        tensors = tuple(TensorInfo(n, int(q), tuple(s), int(o), int(b), str(d), tuple(i))
                        for n, q, s, o, b, d, i in raw["tensors"])
        return GGUFIndex(path, dict(raw["metadata"]), tensors)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        load_cache.log.warning("load_cache_entry_corrupt", path=str(cached), error=str(e))
        return None


__all__ = ["GGUFIndex", "MAX_ARRAY_LEN", "TensorInfo", "read_index"]
