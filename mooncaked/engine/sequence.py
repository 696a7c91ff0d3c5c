"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time

from .detokenizer import IncrementalDetokenizer
from .handover import HandOver
from .types import SamplingParams


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, pages and progress of one request.

    token_ids holds prompt + generated tokens; `num_computed_tokens` of them have K/V
    in the sequence's pages (`block_table`, block ids in order). `block_keys` are
    the chained keys of its full blocks, extended as blocks fill. `handover` is the
    K/V and first token it brings from (or gives to) another node, None for a plain
    request (handover.py). `grammar` is the matcher of a request with a structured-output
    constraint (engine/structured.py), None otherwise. `prompt_logprobs`: the prompt
    tokens scored so far (None first) when params.prompt_logprobs asks for them, else None;
    `wants_prompt_logprobs` is True until all of them are scored.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 salt: bytes, max_tokens: int, detokenizer: IncrementalDetokenizer):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.salt = salt
        self.max_tokens = max_tokens
        self.detokenizer = detokenizer
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0       # leading blocks whose keys are published
        self.num_cached_tokens = 0          # prefix hit of the first admission (reported in usage)
        self.prefix_hit_counted = False
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.handover: HandOver | None = None
        self.grammar = None                 # xgrammar matcher of a constrained request (structured.py)
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt tokens asked to be scored are not all scored yet (their
        positions must be computed, not taken from a prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def first_output_position(self) -> int:
        """Position of the request's first generated token: the prompt's length less
        params.output_offset (a resumed request's prompt ends with its earlier output).
        Tokens before it are prompt tokens, from it on generated ones (ModelRunner.prepare
        gives them the prefill and the decode path)."""
        return self.num_prompt_tokens - self.params.output_offset

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token lacks K/V (prefill or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1
