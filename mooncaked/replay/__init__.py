"""Trace replay against any OpenAI-compatible endpoint (`mooncake bench trace`).

Reads a Mooncake-format trace (JSONL: `timestamp` ms, `input_length`, `output_length`,
`hash_ids` at 512 tokens a block, optional `text_input`), turns each hash id into a fixed
pseudo-random block of token ids so equal ids give equal prefixes, sends every request at
its timestamp times a time scale as a streaming completion, and measures TTFT, TBT and
prefix-cache hits with the shared definitions of `mooncaked.measures`.

Modules: `trace` (parse), `prompts` (hash ids -> token ids), `runner` (send, record),
`summary` (aggregate), `report` (JSON file, PNG CDFs).
"""

from .prompts import PromptBuilder
from .runner import ReplayConfig, ReplayProgress, RequestRecord, discover_server, replay
from .summary import summarize
from .trace import TraceError, TraceRequest, load_trace

__all__ = [
    "PromptBuilder", "ReplayConfig", "ReplayProgress", "RequestRecord", "TraceError",
    "TraceRequest", "discover_server", "load_trace", "replay", "summarize",
]
