"""When a request stops: the one check the engine (every sampled token) and a CPP group's
last stage (the first token, cluster/cpp/cpp_node.py) share, so the two cannot disagree.

Order (vLLM's): an end-of-sequence token (unless ignore_eos), a stop token id, a stop
string the detokenizer found, a structured-output constraint that is complete, then the
length limit.

`held_back` is the other half of the hand-over of a disaggregated request: the part of
the prefill node's first token that the API node sends at once, and that the decode
node, continuing the request, therefore never sends again.
"""

from __future__ import annotations

from collections.abc import Collection

from .types import SamplingParams


def finish_reason(token: int, params: SamplingParams, eos_token_ids: Collection[int],
                  stop_string: str | None, grammar_done: bool, num_output_tokens: int,
                  max_tokens: int) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) after `token` was sampled.

    Args:
        token: the token just sampled (a vocabulary id).
        params: the request's SamplingParams (ignore_eos, stop_token_ids).
        eos_token_ids: the tokenizer's end-of-sequence ids.
        stop_string: the stop string the request's IncrementalDetokenizer matched, or None.
        grammar_done: the request's structured-output matcher has terminated (after
            accepting `token`); False without a constraint.
        num_output_tokens: tokens generated so far, `token` included.
        max_tokens: the request's output limit (tokens).
    Returns: ("stop", None) for end of sequence or a complete constraint, ("stop", the
        token id or string) for a stop token or string, ("length", None) at the limit,
        (None, None) to go on.
    """
    if not params.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in (params.stop_token_ids or ()):
        return "stop", token
    if stop_string is not None:
        return "stop", stop_string
    if grammar_done:
        return "stop", None              # the constraint is complete (even with ignore_eos)
    if num_output_tokens >= max_tokens:
        return "length", None
    return None, None


def held_back(text: str, stop: list[str]) -> str:
    """The part of a first token's text `text` that is safe to send before the next token
    is known: without a trailing incomplete character ("\ufffd"), and without a suffix
    that could start one of the `stop` strings (the IncrementalDetokenizer holds those
    back too). The API node sends this much with the prefill node's first token
    (cluster/frontend.py); a decode node's engine starts its text after it
    (LLMEngine.add_request with first_token)."""
    text = text.rstrip("\ufffd")
    for k in range(min(max((len(s) for s in stop), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stop if s):
            return text[:-k]
    return text


__all__ = ["finish_reason", "held_back"]
