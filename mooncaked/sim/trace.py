"""Request traces in the Mooncake format ("mooncake_trace"): one JSON object a line.

Fields: `timestamp` (arrival, ms after the first request), `input_length` (prompt
tokens), `output_length` (generated tokens), `hash_ids` (prefix-block keys, 512 tokens
a block; equal ids mean equal prefixes). An optional `text_input` is ignored here.
See shared/traces/README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import orjson

TRACE_BLOCK_TOKENS = 512


class TraceRequest(NamedTuple):
    """One request: arrival (seconds after the first), prompt and output tokens, block keys."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Reads a Mooncake-format trace, sorted by arrival (stable).

    Args:
        path: the .jsonl file.
        limit: keep only the first `limit` requests (in file order).
    Raises: ValueError naming the file and line of the first malformed record; OSError
        when the file cannot be read.
    """
    out: list[TraceRequest] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                r = orjson.loads(line)
                req = TraceRequest(float(r["timestamp"]) / 1000.0, int(r["input_length"]),
                                   int(r["output_length"]), tuple(r["hash_ids"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {e}") from e
            if req.input_tokens < 0 or req.output_tokens < 0 or req.arrival_s < 0:
                raise ValueError(f"{path}:{lineno}: negative timestamp or length")
            out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival_s)
    return out
