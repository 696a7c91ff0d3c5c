"""Logprobs in the OpenAI response shapes, keeping each token's identity.

A token of a byte-level vocabulary may hold part of a UTF-8 character (an emoji
is often 3-4 tokens). Its `bytes` are its real bytes (the tokenizer's
`token_bytes`), so the bytes of a choice's tokens concatenate to the UTF-8 of
its text. Its token string is its text when those bytes are valid UTF-8 on
their own, else `bytes:\\xNN...` as OpenAI writes such tokens; with
`return_tokens_as_token_ids` (vLLM's option) every token is `token_id:N`. In a
completions `top_logprobs` dict (keyed by token string) two ids with the same
string would collide; the later one is keyed `token_id:N` so none is lost.

Every logprob is a finite number. The values are those of the model's raw
distribution after the structured-output mask (vLLM V1's default
`logprobs_mode="raw_logprobs"`: its grammar bitmask is applied to the logits
before the sampler computes them), so an alternative the grammar forbids has
logprob -inf; like vLLM's OpenAI server (`max(logprob, -9999.0)`) it is
answered as LOGPROB_FLOOR = -9999.0, never null (which the OpenAI schema does
not allow). One process, P/D, CPP and a resumed stream all answer through here.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field

from mooncaked.engine.types import TokenLogprob

from .engine_client import ApiTokenizer


LOGPROB_FLOOR = -9999.0     # what vLLM and the OpenAI API answer for an impossible token


def clamp_logprob(value: float) -> float:
    """A logprob as the API answers it: at least LOGPROB_FLOOR (-inf and NaN become it)."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_string(tok: ApiTokenizer, token_id: int, as_ids: bool = False) -> tuple[str, bytes]:
    """(token string, token bytes) of one token id (see the module doc)."""
    raw = tok.token_bytes(token_id)
    if as_ids:
        return f"token_id:{token_id}", raw
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_logprobs(lps: list[TokenLogprob], tok: ApiTokenizer, as_ids: bool = False) -> dict:
    """OpenAI chat logprobs {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = token_string(tok, token_id, as_ids)
        return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


@dataclass
class TextOffset:
    """Character offset into a completion's text, advanced by token bytes (a token that
    ends mid-character advances it when the character completes). One per choice."""

    chars: int = 0
    _dec: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def advance(self, raw: bytes) -> None:
        self.chars += len(self._dec.decode(raw))


def completion_logprobs(lps: list[TokenLogprob], tok: ApiTokenizer, offset: TextOffset,
                        as_ids: bool = False) -> dict:
    """OpenAI completions logprobs {tokens, token_logprobs, top_logprobs, text_offset};
    `offset` (the choice's) is advanced past these tokens."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        text, raw = token_string(tok, lp.token_id, as_ids)
        top: dict[str, float] = {}
        owner: dict[str, int] = {}
        for t, v in [*lp.top, (lp.token_id, lp.logprob)]:  # as vLLM: the sampled one is listed
            key = token_string(tok, t, as_ids)[0]
            if owner.get(key, t) != t:
                key = f"token_id:{t}"
            if key not in top:
                top[key], owner[key] = clamp_logprob(v), t
        out["tokens"].append(text)
        out["token_logprobs"].append(clamp_logprob(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset.chars)
        offset.advance(raw)
    return out


def echo_logprobs(prompt_ids: list[int], scored: list[TokenLogprob | None], top_n: int,
                  tok: ApiTokenizer, offset: TextOffset, as_ids: bool = False) -> dict:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy `echo` with
    `logprobs`): one entry per prompt token, the first (nothing before it) with
    token_logprobs and top_logprobs null as OpenAI answers it; each other one with its
    logprob and its top `top_n` alternatives (and itself), as completion_logprobs.

    Args: prompt_ids: the prompt's token ids; scored: RequestOutput.prompt_logprobs
        (len(prompt_ids) entries, None first); offset: the choice's, from 0.
    Returns: {tokens, token_logprobs, top_logprobs, text_offset}; the output's entries
        (completion_logprobs with the same `offset`) follow them.
    """
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(prompt_ids, scored):
        if lp is None:
            text, raw = token_string(tok, token_id, as_ids)
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset.chars)
            offset.advance(raw)
            continue
        one = completion_logprobs([TokenLogprob(lp.token_id, lp.logprob, lp.top[:top_n])],
                                  tok, offset, as_ids)
        for key, values in one.items():
            out[key] += values
    return out


def prompt_logprobs_field(scored: list[TokenLogprob | None], tok: ApiTokenizer,
                          as_ids: bool = False) -> list[dict | None]:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per
    token {token id (a JSON key string): {"logprob", "rank", "decoded_token"}}: the prompt
    token itself with its rank, and its top alternatives ranked 1, 2, ... (vLLM's
    Logprob; every logprob at least LOGPROB_FLOOR)."""
    field_: list[dict | None] = []
    for lp in scored:
        if lp is None:
            field_.append(None)
            continue
        entry = {lp.token_id: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                               "decoded_token": token_string(tok, lp.token_id, as_ids)[0]}}
        for r, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(t, {"logprob": clamp_logprob(v), "rank": r,
                                 "decoded_token": token_string(tok, t, as_ids)[0]})
        field_.append({str(t): v for t, v in entry.items()})
    return field_
