"""Prompts from hash ids: each id is a fixed pseudo-random block of token ids.

The same id always yields the same block (seeded by the id, independent of process,
platform and library versions: SHAKE-128 of the id), so requests whose hash_ids share a
prefix get token prompts that share that prefix, and a server's prefix cache sees the
trace's reuse. Source: architecture.md "Block keys" (the live benchmark's prompts).
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

import numpy as np

from .trace import TRACE_BLOCK_TOKENS, TraceRequest

DEFAULT_VOCAB_SIZE = 49152
"""SmolLM2's vocabulary; used when neither the user nor the server gives one."""
DEFAULT_TOKEN_LOW = 1000
"""Lowest token id drawn: most tokenizers keep special tokens at the bottom of the range."""


def scale_length(n: int, length_scale: float) -> int:
    """A trace length (tokens) divided by `length_scale`, rounded up, at least 1 (n >= 1)."""
    return max(1, math.ceil(n / length_scale)) if n > 0 else 0


class PromptBuilder:
    """Builds token-id prompts from a trace's hash ids.

    Args:
        vocab_size: token ids are drawn from [token_low, vocab_size).
        length_scale: divides every length: a 512-token block becomes
            round(512 / length_scale) tokens (at least 1), input and output lengths become
            ceil(length / length_scale). 1.0 replays the trace's lengths.
        token_low: lowest token id drawn (keeps clear of special tokens).
        block_tokens: tokens per hash id in the trace (512 for Mooncake traces).
    Raises: ValueError if length_scale <= 0 or token_low is outside [0, vocab_size).
    """

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE, length_scale: float = 1.0,
                 token_low: int = DEFAULT_TOKEN_LOW, block_tokens: int = TRACE_BLOCK_TOKENS):
        if not length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {length_scale}")
        if not 0 <= token_low < vocab_size:
            raise ValueError(f"need 0 <= token_low < vocab_size, got {token_low} and {vocab_size}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.vocab_size = vocab_size
        self.token_low = token_low
        self.length_scale = length_scale
        self.full_block_tokens = block_tokens
        self.block_len = max(1, round(block_tokens / length_scale))
        # One cache per builder: the trace reuses hot ids (id 0 starts most requests).
        self._block = lru_cache(maxsize=65536)(self._make_block)

    def _stream(self, seed: str, n: int) -> list[int]:
        raw = hashlib.shake_128(seed.encode()).digest(4 * n)
        words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
        return (self.token_low + words % (self.vocab_size - self.token_low)).tolist()

    def _make_block(self, hash_id: int) -> tuple[int, ...]:
        # The full 512-token block is fixed by the id; scaling keeps its first block_len tokens.
        return tuple(self._stream(f"mooncake-replay/block/{hash_id}",
                                  self.full_block_tokens)[:self.block_len])

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The block_len token ids of one hash id (same id -> same tokens), ints."""
        return self._block(hash_id)

    def input_length(self, req: TraceRequest) -> int:
        """Scaled prompt length of a request, tokens (>= 1)."""
        return max(1, scale_length(req.input_length, self.length_scale))

    def output_length(self, req: TraceRequest) -> int:
        """Scaled output length (max_tokens) of a request, tokens (>= 1)."""
        return max(1, scale_length(req.output_length, self.length_scale))

    def prompt(self, req: TraceRequest) -> list[int]:
        """Token ids of a request's prompt, exactly `input_length(req)` long.

        The concatenated blocks of its hash_ids, cut to the scaled input length. When the
        blocks are too short (a trace whose lengths exceed its ids, or rounding of the
        scaled block), the rest is a tail unique to this request index, so it is never a
        false prefix hit.
        """
        n = self.input_length(req)
        out: list[int] = []
        for h in req.hash_ids:
            if len(out) >= n:
                break
            out.extend(self.block(h))
        if len(out) < n:
            out.extend(self._stream(f"mooncake-replay/tail/{req.index}", n - len(out)))
        return out[:n]
