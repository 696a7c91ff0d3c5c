"""Mooncake-format trace files (the "mooncake_trace" JSONL format).

One JSON object a line: `timestamp` (ms after the first request), `input_length` and
`output_length` (tokens), `hash_ids` (remapped prefix-block keys, 512 tokens a block;
equal ids mean equal prefixes up to that block), and optionally `text_input` (a prompt
text to send as is). Source: kvcache-ai/Mooncake FAST25-release/traces; see
shared/traces/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and reason."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    index: 0-based position in the file (blank lines skipped). timestamp_ms: arrival, ms
    after the first request. input_length / output_length: tokens. hash_ids: prefix-block
    keys, 512 tokens each. text_input: prompt text, or None to build one from hash_ids.
    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = field(default_factory=tuple)
    text_input: str | None = None


def _field_int(obj: dict, key: str, where: str, minimum: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: '{key}' must be an integer >= {minimum}, got {v!r}")
    return v


def parse_line(line: str | bytes, index: int, where: str) -> TraceRequest:
    """Parse one JSONL line into a TraceRequest.

    Raises TraceError (naming `where`, e.g. "trace.jsonl:12") for bad JSON, a missing or
    negative length or timestamp, non-integer hash ids, or a non-string text_input.
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    text = obj.get("text_input")
    if text is not None and not isinstance(text, str):
        raise TraceError(f"{where}: 'text_input' must be a string, got {type(text).__name__}")
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    input_length = _field_int(obj, "input_length", where, 0 if text is not None else 1)
    output_length = _field_int(obj, "output_length", where, 1)
    return TraceRequest(index=index, timestamp_ms=float(ts), input_length=input_length,
                        output_length=output_length, hash_ids=tuple(ids), text_input=text)


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read the first `limit` requests (all when None) of a trace file, sorted by timestamp.

    The sort is stable, so requests with equal timestamps keep their file order.
    Raises TraceError for an unreadable file or a bad line (naming file:line), and
    ValueError for limit < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = Path(path)
    out: list[TraceRequest] = []
    try:
        with path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                out.append(parse_line(line, len(out), f"{path}:{lineno}"))
                if limit is not None and len(out) >= limit:
                    break
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    if not out:
        raise TraceError(f"{path}: no requests")
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def shared_trace_path(name: str = "conversation_trace.jsonl") -> Path | None:
    """The project's shared request trace, if present: `shared/traces/NAME` beside the
    checkout (as laid out for developers and CI), else $MOONCAKE_TRACE_DIR/NAME; None if
    neither exists."""
    import os  # noqa: PLC0415

    repo = Path(__file__).resolve().parents[2]
    candidates = [repo.parent / "shared" / "traces" / name, repo / "shared" / "traces" / name]
    if os.environ.get("MOONCAKE_TRACE_DIR"):
        candidates.insert(0, Path(os.environ["MOONCAKE_TRACE_DIR"]) / name)
    return next((p for p in candidates if p.is_file()), None)
