"""Request-level types shared by the engine and the API: sampling parameters and outputs."""

from __future__ import annotations

from typing import Any
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on a request's output text (structured outputs), as plain data.

    It is the constraint, not the matcher's state: it crosses node boundaries inside
    SamplingParams (P/D), and the receiving engine re-creates the matcher from it and
    advances it over the tokens so far (engine/structured.py).

    kind: "json" (value: a JSON schema as canonical JSON text), "json_object" (value ""; any
    JSON object), "regex" (value: the pattern), "choice" (value: a JSON list of strings; the
    output is exactly one of them) or "grammar" (value: an EBNF grammar, GBNF syntax).
    """

    kind: str
    value: str = ""

    KINDS = ("json", "json_object", "regex", "choice", "grammar")


class InvalidRequest(ValueError):
    """A request the engine cannot run as asked (bad parameter, prompt too long).

    `param` names the offending parameter (OpenAI's error `param`), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop (OpenAI/vLLM semantics).

    temperature 0 means greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable their
    filters. Penalties follow vLLM: repetition_penalty divides positive logits (and
    multiplies negative ones) of tokens seen in prompt or output; presence_penalty and
    frequency_penalty subtract from logits of tokens already generated. `seed` makes
    sampling reproducible per request. `max_tokens` None means up to the context
    length. `logprobs` None returns no logprobs; k >= 0 returns the sampled token's
    logprob and the top k alternatives (from the model's raw distribution).
    `structured` constrains the output (StructuredSpec; None: free text).
    `prompt_logprobs` None computes none; k >= 0 scores every prompt token after the first
    (vLLM's prompt_logprobs: its logprob and rank, plus the top k alternatives, from the
    raw distribution of the logits at the position before it); they come back with the
    first output (RequestOutput.prompt_logprobs). Such a request skips the prefix cache
    and the store's prefix (as vLLM does): cached positions have no logits.
    `output_offset` (tokens, internal: the public API leaves it 0) says that the prompt's
    last `output_offset` tokens are this request's own output, streamed before it was
    resumed on other nodes (cluster/frontend.py re-places a request whose decode node
    died with prompt + streamed tokens): the seeded draw of each position and the
    presence/frequency penalties count them as output, so a resumed request samples
    what the undisturbed one would have; a structured-output matcher replays them.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None
    output_offset: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # A spec that crossed a node boundary as JSON arrives as a dict (messages.py).
        if isinstance(self.structured, dict):
            self.structured = StructuredSpec(**self.structured)   # TypeError for bad fields
        if not (self.structured is None or isinstance(self.structured, StructuredSpec)):
            raise TypeError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")

    def validate(self, max_logprobs: int = 20) -> None:
        """Raises InvalidRequest naming the parameter if a value is out of range."""
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= max_logprobs, "logprobs",
             f"must be in [0, {max_logprobs}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_logprobs,
             "prompt_logprobs", f"must be in [0, {max_logprobs}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (len(self.stop) <= 16, "stop", f"holds {len(self.stop)} strings; at most 16 are allowed"),
            (isinstance(self.output_offset, int) and self.output_offset >= 0, "output_offset",
             "must be a non-negative integer"),
            (self.structured is None or self.structured.kind in StructuredSpec.KINDS,
             "structured_outputs", f"kind must be one of {', '.join(StructuredSpec.KINDS)}"),
        ]
        for ok, param, why in checks:
            if not ok:
                raise InvalidRequest(f"{param} {why}", param)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class TokenLogprob:
    """Logprob of one token and its top alternatives (natural log), most likely first.

    `rank`: the token's 1-based rank in its distribution (vLLM's: how many tokens have a
    logprob >= its own), 0 when not computed (generated tokens; prompt tokens have it).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0


@dataclass
class KVImport:
    """K/V handed to a request at admission instead of being computed.

    blocks: [n, num_layers, 2, block_size, num_kv_heads, head_dim] (CPU or the engine's
    device, any float dtype) covering the first `num_tokens` tokens of the prompt
    (the last block may be partial). Used by a decode node (KV from the prefill
    node) and for prefix hits loaded from the store.
    """

    blocks: torch.Tensor
    num_tokens: int


@dataclass
class KVExport:
    """K/V of a finished request, gathered out of the pages before they are freed.

    blocks: [n, num_layers, 2, block_size, num_kv_heads, head_dim], the engine's dtype, in
    host memory (pinned on CUDA), covering the first `num_tokens` tokens (the last block
    may be partial); keys: block keys of the leading full blocks (len(keys) <= n).
    ready: None when `blocks` holds the bytes already (CPU engines); on CUDA a
        torch.cuda.Event that completes when the copy out of the pages (on the copy
        stream, engine/staging.py) has landed: wait on it before reading `blocks`.
    """

    keys: list[bytes]
    blocks: torch.Tensor
    num_tokens: int
    ready: object | None = None


@dataclass
class RequestOutput:
    """What one request produced since its previous output (a streaming delta).

    `new_text` is detokenized text that is safe to send: text that might be the start
    of a stop string is held back until it is known not to be, and a matched stop
    string is never included (unless include_stop_str_in_output).
    `prompt_logprobs` (SamplingParams.prompt_logprobs asked): one entry per prompt token,
    None for the first, on the first output that carries a token only.
    finish_reason: None while running, else "stop" (EOS, stop string or stop token),
    "length" (max_tokens or context full) or "abort". `stop_reason` is the matched
    stop string or stop token id, if any.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    kv_export: KVExport | None = None
    emitted_s: float | None = None      # time.time() when the step that made it ended
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine for metrics and inspection (counts, tokens, blocks)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    prefix_hit_tokens_total: int
    num_preemptions_total: int


@dataclass(frozen=True)
class KVGeometry:
    """The engine's paged KV layout, as peers need it to exchange blocks.

    A block is every layer's K and V for `block_size` tokens: [num_layers, 2,
    block_size, num_kv_heads, head_dim] elements of `dtype` (a torch dtype), `block_bytes`
    bytes; the engine has `num_blocks` of them.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    block_bytes: int
    num_blocks: int

    @property
    def dtype_name(self) -> str:
        """"float32", "bfloat16", ... (the dtype without its "torch." prefix)."""
        return str(self.dtype).removeprefix("torch.")

    def layer_major_shape(self, num_blocks: int) -> list[int]:
        """Shape of a layer-major KV buffer of num_blocks blocks (a stage or receive buffer):
        [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]."""
        return [self.num_layers, num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim]


@dataclass(frozen=True)
class StartupProfile:
    """What a cluster model node's start-up profile measured (engine/startup_profile.py);
    published in its member record, read by the conductor (plain data: the conductor's
    floor may import it).

    Attributes:
        seconds: wall time of the whole profile, seconds.
        budget_s: engine.startup_profile_s it ran under.
        complete: whether it ran its whole plan (False: the budget ended it early).
        prefill_steps: (new tokens, tokens cached before them, seconds) of each timed step
            of prefill chunks only, as LLMEngine.prefill_steps.
        decode_steps: (batch size, context tokens, seconds) of each pure decode step, as
            LLMEngine.decode_steps.
        cached: the steps come from an earlier complete run on this machine with the same
            model, settings and threads (the profile cache), not from this start.
        cpu_share: the share of its torch threads' CPU time the profile got (process CPU
            seconds / (wall seconds x torch threads), at most 1): below 1 other processes
            (another node loading, compiling) took the cores, and its step times are slower
            than the machine is.
        contended: cpu_share was below startup_profile.MIN_CPU_SHARE: used, not cached.
    """

    seconds: float
    budget_s: float
    complete: bool
    prefill_steps: tuple[tuple[int, int, float], ...] = ()
    decode_steps: tuple[tuple[int, int, float], ...] = ()
    cached: bool = False
    cpu_share: float = 1.0
    contended: bool = False

    def to_json(self) -> dict[str, Any]:
        """The member record's form (see `from_json`)."""
        return {"seconds": round(self.seconds, 3), "budget_s": self.budget_s,
                "complete": self.complete, "cached": self.cached,
                "cpu_share": round(self.cpu_share, 3), "contended": self.contended,
                "prefill_steps": [[n, c, round(s, 6)] for n, c, s in self.prefill_steps],
                "decode_steps": [[b, c, round(s, 6)] for b, c, s in self.decode_steps]}

    @classmethod
    def from_json(cls, d: Any) -> StartupProfile:
        """Inverse of `to_json`. Raises: ValueError on a malformed object."""
        try:
            return cls(float(d["seconds"]), float(d["budget_s"]), bool(d["complete"]),
                       tuple((int(n), int(c), float(s)) for n, c, s in d["prefill_steps"]),
                       tuple((int(b), int(c), float(s)) for b, c, s in d["decode_steps"]),
                       bool(d.get("cached", False)), float(d.get("cpu_share", 1.0)),
                       bool(d.get("contended", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed startup profile: {e}") from None

    def summary(self) -> dict[str, Any]:
        """Seconds, budget, completeness and step counts (no steps): for status."""
        return {"seconds": round(self.seconds, 3), "budget_s": self.budget_s,
                "complete": self.complete, "cached": self.cached,
                "cpu_share": round(self.cpu_share, 3), "contended": self.contended,
                "prefill_steps": len(self.prefill_steps),
                "decode_steps": len(self.decode_steps)}
