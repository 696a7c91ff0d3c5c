"""OpenAI request parsing: JSON bodies -> validated, tokenized generation requests.

Every check raises `ApiError` carrying the HTTP status and OpenAI's error fields
(`message`, `type`, `param`, `code`), so the server answers bad input with the
right 4xx and keeps serving. Follows the OpenAI API reference for
/v1/completions and /v1/chat/completions, plus vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, include_stop_str_in_output,
cache_salt), structured outputs and tool calls (api/structured.py: response_format,
structured_outputs and guided_*, tools and tool_choice).

What is supported: prompts as a string, a list of token ids, or a batch (a list
of strings or of token-id lists); n >= 1 (each choice is its own engine
request); echo, with logprobs too (the prompt's tokens scored as OpenAI's legacy
completions did: the first token's logprob null), and `max_tokens: 0` with echo (only
the prompt scored, what lm-evaluation-harness's loglikelihood requests send; the engine
runs one token that is not answered, as vLLM does); vLLM's `prompt_logprobs: k` (k in
[0, max_logprobs]; vLLM's -1, the whole vocabulary, is a 400). What gets a 400 "not
supported": suffix, logit_bias, best_of other than n, non-text content parts, the
deprecated functions / function_call, tool_choice "auto" on a template without a tool format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from mooncaked.engine.types import InvalidRequest, SamplingParams

from .engine_client import EngineInfo
from .errors import ApiError, error_body
from .structured import parse_constraint, parse_tools

MAX_CHOICES = 64          # prompts x n per API request: bounds the engine requests one call makes
MAX_SEED = 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Prompt:
    """One prompt of a request: its token ids and, for echo, its text."""

    token_ids: list[int]
    text: str


@dataclass
class GenerationRequest:
    """A parsed, validated /v1/completions or /v1/chat/completions request.

    `prompts` holds one entry per prompt (chat: exactly one); each prompt runs `n`
    engine requests, so the response has len(prompts) * n choices, choice index
    prompt_index * n + i (as OpenAI orders them). `logprobs` is the number of top
    alternatives asked for (None: no logprobs); `params.seed` is the seed of choice 0
    (choice i uses seed + i, so choices differ but stay reproducible).
    """

    kind: str                      # "completion" | "chat"
    model: str
    prompts: list[Prompt]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    user: str | None = None
    extra: dict = field(default_factory=dict)
    tokens_as_ids: bool = False    # vLLM's return_tokens_as_token_ids: logprob tokens "token_id:N"
    tools: Any = None              # api/structured.py ToolPlan of a chat request with tools
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs asked (the response field)
    echo_only: bool = False        # max_tokens 0 with echo: the prompt alone is answered


# ---------------------------------------------------------------------------- typed getters

_MISSING = object()


def _type_error(key: str, expected: str, value: Any) -> ApiError:
    got = "null" if value is None else type(value).__name__
    return ApiError(400, f"'{key}' must be {expected}, got {got}", param=key,
                    code="invalid_type")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_id_like(v: Any) -> bool:
    """An int, or an integer too wide for 64 bits that the JSON parser (orjson) gave as a
    float: a token id out of the vocabulary, to be reported as such, not as a float."""
    return _is_int(v) or (isinstance(v, float) and v.is_integer() and abs(v) >= 2.0 ** 63)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, key: str, default: Any) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) >= 2**63:
        # orjson reads integers beyond 64 bits as floats: say what is really wrong.
        raise ApiError(400, f"'{key}' must be an integer in [-2**63, 2**63)", param=key,
                       code="invalid_value")
    if not _is_int(v):
        raise _type_error(key, "an integer", v)
    return v


def _num(body: dict, key: str, default: Any) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not _is_num(v):
        raise _type_error(key, "a number", v)
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(key, "a boolean", v)
    return v


def _str(body: dict, key: str, default: Any) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(key, "a string", v)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    if isinstance(v, list):       # say which item, not only "got list"
        bad = next(s for s in v if not isinstance(s, str))
        raise _type_error("stop", "a string or a list of strings (token ids go in "
                          "stop_token_ids)", bad)
    raise _type_error("stop", "a string or a list of strings", v)


def token_ids(v: Any, key: str, vocab_size: int) -> list[int]:
    """`v` checked as a list of token ids in [0, vocab_size). Raises ApiError 400 that
    names the first wrong element by place (`key[i]`) and says what it is."""
    if not isinstance(v, list):
        raise _type_error(key, "a list of integers", v)
    for i, t in enumerate(v):     # name the element, not the list
        if not _is_token_id_like(t):
            raise _type_error(f"{key}[{i}]", "a token id (an integer)", t)
        if not 0 <= t < vocab_size:
            # an id wider than 64 bits arrives as a rounded float: do not print the rounding
            shown = t if _is_int(t) else "wider than 64 bits"
            raise ApiError(400, f"'{key}[{i}]': token id {shown} is outside the vocabulary "
                                f"[0, {vocab_size})", param=f"{key}[{i}]", code="invalid_value")
    return list(v)


# ---------------------------------------------------------------------------- parsing


def parse_json(raw: bytes) -> dict:
    """Decodes a request body (orjson). Raises ApiError 400 unless it is a JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def check_model(body: dict, engine: EngineInfo) -> str:
    """The requested model name; a missing model means the served one.

    Raises ApiError 404 model_not_found for another name (as OpenAI does), 400 for a
    non-string.
    """
    model = _str(body, "model", engine.model_name)
    if model != engine.model_name:
        raise ApiError(404, f"The model '{model}' does not exist (this server serves "
                            f"'{engine.model_name}')", param="model", code="model_not_found")
    return model


def _reject_unsupported(body: dict, kind: str) -> None:
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", param="suffix", code="unsupported")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias",
                       code="unsupported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of",
                       code="unsupported")


def _sampling(body: dict, max_tokens_key: str, max_tokens: int | None) -> SamplingParams:
    """SamplingParams from the body; types checked here, ranges by SamplingParams.validate."""
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'{max_tokens_key}' must be at least 1, got {max_tokens}",
                       param=max_tokens_key)
    seed = _int(body, "seed", None)
    if seed is not None and not -MAX_SEED - 1 <= seed <= MAX_SEED:
        raise ApiError(400, "'seed' must fit in a signed 64-bit integer", param="seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        min_p=_num(body, "min_p", 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0),
        presence_penalty=_num(body, "presence_penalty", 0.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0),
        seed=seed,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )


def _common(body: dict, kind: str, engine: EngineInfo, prompts: list[Prompt],
            params: SamplingParams, logprobs: int | None, max_tokens_key: str) -> GenerationRequest:
    """Fields shared by both endpoints, then whole-request checks (ranges, lengths)."""
    vocab = engine.tokenizer.vocab_size
    stop_ids = body.get("stop_token_ids")
    params.stop_token_ids = [] if stop_ids is None else token_ids(stop_ids, "stop_token_ids",
                                                                    vocab)
    params.logprobs = logprobs
    n = _int(body, "n", 1)
    if n < 1:
        raise ApiError(400, f"'n' must be at least 1, got {n}", param="n")
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request",
                       param="n")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           param="stream_options")
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        include_usage = _bool(opts, "include_usage", False)
    cache_salt = _str(body, "cache_salt", None)
    if cache_salt == "":
        raise ApiError(400, "'cache_salt' must not be empty", param="cache_salt")
    try:
        params.validate(engine.max_logprobs)
    except InvalidRequest as e:
        param = max_tokens_key if e.param == "max_tokens" else e.param
        if kind == "chat" and e.param == "logprobs":
            param = "top_logprobs"
        raise ApiError(400, str(e).replace(e.param or "", param or "", 1), param=param) from None
    v = body.get("prompt")
    # a batch of prompts (strings or token lists) names the one at fault by place
    batch = kind != "chat" and isinstance(v, list) and bool(v) and all(
        isinstance(x, (str, list)) for x in v)
    for i, p in enumerate(prompts):
        _check_length(p, params, engine, "messages" if kind == "chat" else
                      f"prompt[{i}]" if batch else "prompt", max_tokens_key)
    return GenerationRequest(
        kind=kind, model=engine.model_name, prompts=prompts, params=params, n=n, stream=stream,
        include_usage=include_usage, logprobs=logprobs, cache_salt=cache_salt,
        user=_str(body, "user", None),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False))


def _check_length(p: Prompt, params: SamplingParams, engine: EngineInfo, param: str,
                  max_tokens_key: str) -> None:
    """Prompt + max_tokens must fit in the context (vLLM and OpenAI answer 400)."""
    limit = engine.max_model_len
    n = len(p.token_ids)
    if n == 0:
        raise ApiError(400, f"'{param}' must not be empty (it has no tokens)", param=param,
                       code="invalid_value")
    if n >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; the "
                            f"prompt has {n} tokens, leaving no room for output", param=param,
                       code="context_length_exceeded")
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; you "
                            f"requested {n + params.max_tokens} tokens ({n} in the prompt, "
                            f"{params.max_tokens} for the output)", param=max_tokens_key,
                       code="context_length_exceeded")


def parse_completion(body: dict, engine: EngineInfo) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (prompts tokenized, defaults applied).

    `prompt`: a string, a list of token ids, a list of strings, or a list of token-id
    lists (a batch). `logprobs`: integer number of top alternatives (OpenAI: 0..5;
    here up to the engine's max_logprobs). max_tokens defaults to 16 as in OpenAI.
    Raises: ApiError (400 bad input, 404 unknown model).
    """
    check_model(body, engine)
    _reject_unsupported(body, "completion")
    prompts = _prompts(body.get("prompt", _MISSING), engine)
    max_tokens = _int(body, "max_tokens", 16)
    echo = _bool(body, "echo", False)
    echo_only = echo and max_tokens == 0     # one token is run and not answered (as vLLM)
    params = _sampling(body, "max_tokens", 1 if echo_only else max_tokens)
    params.structured, _ = parse_constraint(body)
    logprobs = _int(body, "logprobs", None)
    prompt_logprobs = _int(body, "prompt_logprobs", None)
    # echo with logprobs scores the prompt too (vLLM: prompt_logprobs = logprobs)
    params.prompt_logprobs = (max(prompt_logprobs or 0, logprobs)
                              if echo and logprobs is not None else prompt_logprobs)
    req = _common(body, "completion", engine, prompts, params, logprobs, "max_tokens")
    req.echo, req.echo_only, req.prompt_logprobs = echo, echo_only, prompt_logprobs
    return req


def _prompts(v: Any, engine: EngineInfo) -> list[Prompt]:
    tok = engine.tokenizer
    if v is _MISSING or v is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required")
    if isinstance(v, str):
        return [Prompt(tok.encode(v), v)]
    if isinstance(v, list) and v:
        if all(_is_token_id_like(t) for t in v):
            ids = token_ids(v, "prompt", tok.vocab_size)
            return [Prompt(ids, tok.decode(ids))]
        if all(isinstance(s, str) for s in v):
            return [Prompt(tok.encode(s), s) for s in v]
        if all(isinstance(x, list) for x in v):
            out = []
            for j, x in enumerate(v):
                ids = token_ids(x, f"prompt[{j}]", tok.vocab_size)
                out.append(Prompt(ids, tok.decode(ids)))
            return out
    if isinstance(v, list) and not v:
        raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    if isinstance(v, list):
        # name the first element that is none of the three (a float, a bool, an object),
        # not the list itself
        bad = next(((i, x) for i, x in enumerate(v)
                    if not (_is_token_id_like(x) or isinstance(x, (str, list)))), None)
        if bad is not None:
            raise _type_error(f"prompt[{bad[0]}]", "a token id (an integer), a string, or a "
                              "list of token ids", bad[1])
        raise ApiError(400, "'prompt' must be a list of one kind (token ids, strings, or "
                            "lists of token ids); it mixes them", param="prompt",
                       code="invalid_type")
    raise _type_error("prompt", "a string, a list of token ids, or a list of either", v)


def parse_chat(body: dict, engine: EngineInfo) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (chat template applied).

    `messages`: a non-empty list of {role, content} where content is a string or a
    list of {"type": "text", "text": ...} parts (assistant content may be null).
    `logprobs` is a boolean and `top_logprobs` the number of alternatives.
    `max_completion_tokens` wins over the deprecated `max_tokens`; neither means up to
    the context length.
    Raises: ApiError (400 bad input, 404 unknown model).
    """
    check_model(body, engine)
    _reject_unsupported(body, "chat")
    messages = _messages(body.get("messages", _MISSING))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _sampling(body, key, _int(body, key, None))
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    params.structured, source = parse_constraint(body)
    plan, tool_spec = parse_tools(body, getattr(engine.tokenizer, "accepts_tools", False))
    if tool_spec is not None:
        if params.structured is not None:
            raise ApiError(400, f"tool_choice {plan.mode!r} constrains the output; it cannot be "
                                f"combined with '{source}'", param="tool_choice",
                           code="conflicting_constraints")
        params.structured = tool_spec
    try:
        ids = list(engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=plan.tools if plan else None))
    except InvalidRequest as e:
        raise ApiError(400, str(e), param=e.param or "messages") from None
    params.prompt_logprobs = _int(body, "prompt_logprobs", None)
    req = _common(body, "chat", engine, [Prompt(ids, "")], params, logprobs, key)
    req.tools, req.prompt_logprobs = plan, params.prompt_logprobs
    return req


def _messages(v: Any) -> list[dict]:
    if v is _MISSING or v is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required")
    if not isinstance(v, list):
        raise _type_error("messages", "a list of messages", v)
    if not v:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, "
                                f"got {role!r}", param=f"{where}.role")
        msg = {"role": role, "content": _content(m.get("content", _MISSING), where, role)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        # tool-call history, for templates with a tool format
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = m["tool_calls"]
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _content(c: Any, where: str, role: str) -> str:
    key = f"{where}.content"
    if isinstance(c, str):
        return c
    if c is None and role == "assistant":
        return ""
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"'{key}[{j}]': only text content parts are supported, "
                                    f"got {kind!r}", param=f"{key}[{j}]", code="unsupported")
            if not isinstance(part.get("text"), str):
                raise _type_error(f"{key}[{j}].text", "a string", part.get("text"))
            texts.append(part["text"])
        return "\n".join(texts)   # as vLLM joins text parts
    if c is _MISSING:
        raise ApiError(400, f"'{key}' is required", param=key, code="missing_required")
    raise _type_error(key, "a string or a list of text parts", c)
