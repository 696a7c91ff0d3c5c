"""The engine surface the OpenAI API depends on, declared: `EngineClient`.

The API server (server.py) and request parsing (protocol.py) never see an
LLMEngine; they talk to whatever stands in for one:

    mooncaked.engine.async_llm.AsyncLLM          one process, the model runs here
    mooncaked.cluster.frontend.ClusterFrontend   a cluster node's API: placement, then
                                                 prefill and decode on other nodes

Both match these protocols structurally (typing.Protocol: no inheritance), so a
third front end only has to provide the same members. Members are declared as
read-only properties, which plain attributes and properties both satisfy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from mooncaked.engine.types import EngineStats, RequestOutput, SamplingParams


class ApiTokenizer(Protocol):
    """What the API uses of the model's tokenizer (mooncaked.model.tokenizer.Tokenizer)."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        ...

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (logprobs)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs' `bytes`; may be part of a character)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a chat in the model's template (tool definitions rendered when the
        template takes them: the tokenizer's `accepts_tools` attribute, read with getattr,
        False when absent). Raises InvalidRequest for empty messages, a model without a
        template, or messages the template rejects."""
        ...


class EngineInfo(Protocol):
    """What parsing a request needs (protocol.py): the model's name, limits and tokenizer."""

    @property
    def tokenizer(self) -> ApiTokenizer:
        """The served model's tokenizer."""
        ...

    @property
    def model_name(self) -> str:
        """The served model name (OpenAI's `model`)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Context length in tokens: prompt + output tokens of one request."""
        ...

    @property
    def max_logprobs(self) -> int:
        """Largest `logprobs` / `top_logprobs` a request may ask for."""
        ...


class EngineClient(EngineInfo, Protocol):
    """Everything the API server calls: EngineInfo plus running, aborting and counting."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Runs one request (an async generator): its output deltas, the last one with
        finished=True. Raises InvalidRequest (400) or ApiError (e.g. 429, 503) before the
        first delta; a delta may carry `error` for a failure after it. Closing the
        iterator early aborts the request and frees its resources."""
        ...

    def abort(self, request_id: str) -> None:
        """Stops a request that is still running (no-op if unknown or finished)."""
        ...

    def stats(self) -> EngineStats:
        """Counters for /metrics (read at scrape time; cheap, non-blocking)."""
        ...


__all__ = ["ApiTokenizer", "EngineClient", "EngineInfo"]
