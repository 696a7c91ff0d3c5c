"""Typed messages of the cluster: every body that crosses a node boundary.

One frozen dataclass per RPC body and reply (and per line of the internal
decode stream), each with its JSON form in one place: `to_json()` returns a
dict orjson can write, `from_json(d)` builds the message and raises
`MessageError` (a ValueError, so a control server answers 400) for a body that
is not one. Keys travel as hex strings, token ids and shapes as lists; a float
that is not finite (a grammar-masked alternative's logprob is -inf) as the string
"Infinity", "-Infinity" or "NaN" (float_to_json), never as null.

The request path (docs/ARCHITECTURE.md, "The life of a request in a cluster"):

    API node --PlaceRequest--> conductor --PlaceReply | PlaceRejected--> API node
    API node --PrefillRequest--> prefill node
        prefill node --KVReservation--> decode node --KVReserved--> prefill node
        (layer-wise WRITEs into the reserved buffer)
    prefill node --PrefillReply(OutputDelta, KVHandle)--> API node
    API node --DecodeRequest--> decode node --OutputDelta lines | DecodeFailure--> API node
    API node / prefill node --Release--> prefill or decode node
    every node --NodeReport--> conductor
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.engine.types import RequestOutput, SamplingParams, TokenLogprob


class MessageError(ValueError):
    """A body that is not the message it should be (missing or mistyped field)."""


def _get(d: Any, name: str, kind: type | tuple[type, ...], default: Any = dataclasses.MISSING
         ) -> Any:
    """Field `name` of JSON object d, checked against `kind` (None allowed only as a default).

    Raises: MessageError when d is not an object, or the field is missing or mistyped.
    """
    if not isinstance(d, Mapping):
        raise MessageError(f"expected a JSON object, got {type(d).__name__}")
    if name not in d or (d[name] is None and default is not dataclasses.MISSING):
        if default is dataclasses.MISSING:
            raise MessageError(f"missing field {name!r}")
        return default
    v = d[name]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, float)):
        raise MessageError(f"field {name!r}: expected {getattr(kind, '__name__', kind)}, "
                           f"got {type(v).__name__}")
    return v


_NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def float_to_json(x: float) -> float | str:
    """A float in its wire form: a JSON number when finite, else the string "Infinity",
    "-Infinity" or "NaN" (JSON has no such numbers, and orjson would write null)."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def float_from_json(v: Any, field: str) -> float:
    """A wire float (see float_to_json) -> float.

    Raises: MessageError naming `field` for anything else (null included).
    """
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and v in _NON_FINITE:
        return _NON_FINITE[v]
    raise MessageError(f"field {field!r}: expected a number or \"Infinity\", \"-Infinity\", "
                       f"\"NaN\", got {v!r}")


def logprob_to_json(lp: TokenLogprob) -> list:
    """One token's logprobs in their wire form: [token id, logprob, [[id, logprob], ...]]
    (a grammar-masked alternative's -inf as "-Infinity", float_to_json), and its rank as a
    fourth element when it has one (a prompt token's, TokenLogprob.rank)."""
    out = [lp.token_id, float_to_json(lp.logprob),
           [[int(t), float_to_json(v)] for t, v in lp.top]]
    return out + [lp.rank] if lp.rank else out


def logprob_from_json(v: Any, field: str = "logprobs") -> TokenLogprob:
    """logprob_to_json's form -> TokenLogprob. Raises: MessageError naming `field`."""
    try:
        token, value, top, *rest = v
        rank = rest[0] if len(rest) == 1 else 0
        if (not isinstance(token, int) or isinstance(token, bool) or not isinstance(top, list)
                or len(rest) > 1 or not isinstance(rank, int) or isinstance(rank, bool)
                or rank < 0):
            raise TypeError("expected [token id, logprob, [[id, logprob], ...], rank?]")
        pairs = [(a, float_from_json(b, field)) for a, b in top]
        if not all(isinstance(a, int) and not isinstance(a, bool) for a, _ in pairs):
            raise TypeError("a top logprob's token id is not an integer")
    except (TypeError, ValueError) as e:
        if isinstance(e, MessageError):
            raise
        raise MessageError(f"field {field!r}: {e}") from None
    return TokenLogprob(token, float_from_json(value, field), pairs, rank)


def prompt_logprobs_to_json(lps: Sequence[TokenLogprob | None] | None) -> list | None:
    """A request's prompt logprobs in their wire form: null for the first prompt token,
    then logprob_to_json's form per token; None when none were asked."""
    if lps is None:
        return None
    return [None if lp is None else logprob_to_json(lp) for lp in lps]


def prompt_logprobs_from_json(v: Any) -> tuple[TokenLogprob | None, ...] | None:
    """prompt_logprobs_to_json's form -> its entries. Raises: MessageError naming the field."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise MessageError("field 'prompt_logprobs': expected a list")
    return tuple(None if x is None else logprob_from_json(x, "prompt_logprobs") for x in v)


def hex_keys(keys: Sequence[bytes]) -> list[str]:
    """Block keys -> hex strings (their wire form)."""
    return [k.hex() for k in keys]


def unhex_keys(values: Any, field: str = "keys") -> tuple[bytes, ...]:
    """Hex strings -> block keys. Raises: MessageError for anything else."""
    if not isinstance(values, list):
        raise MessageError(f"field {field!r}: expected a list of hex strings")
    try:
        return tuple(bytes.fromhex(v) for v in values)
    except (TypeError, ValueError) as e:
        raise MessageError(f"field {field!r}: not hex strings ({e})") from None


def _ints(values: Any, field: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                               for v in values):
        raise MessageError(f"field {field!r}: expected a list of integers")
    return tuple(values)


def params_to_json(p: SamplingParams) -> dict:
    """SamplingParams -> its fields as a JSON object."""
    return dataclasses.asdict(p)


def params_from_json(d: Any) -> SamplingParams:
    """A JSON object of SamplingParams fields -> SamplingParams (unknown fields refused).

    Raises: MessageError for a non-object or an unknown field.
    """
    if not isinstance(d, Mapping):
        raise MessageError("field 'params': expected an object")
    try:
        return SamplingParams(**d)
    except TypeError as e:
        raise MessageError(f"field 'params': {e}") from None


# ---------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class NodeRef:
    """Where a node is: id, control address (host:port) and API URL."""

    node: str
    control: str
    api: str = ""

    def to_json(self) -> dict:
        return {"node": self.node, "control": self.control, "api": self.api}

    @classmethod
    def from_json(cls, d: Any) -> NodeRef:
        return cls(_get(d, "node", str), _get(d, "control", str), _get(d, "api", str, ""))


@dataclass(frozen=True)
class FetchPlan:
    """Prefix blocks a prefill node copies from `source` (control address `control`) into
    its store before prefilling (paper section 4.2)."""

    source: str
    control: str
    keys: tuple[bytes, ...]

    def to_json(self) -> dict:
        return {"source": self.source, "control": self.control, "keys": hex_keys(self.keys)}

    @classmethod
    def from_json(cls, d: Any) -> FetchPlan:
        return cls(_get(d, "source", str, ""), _get(d, "control", str),
                   unhex_keys(_get(d, "keys", list)))


@dataclass(frozen=True)
class PlaceRequest:
    """`conductor.place`: place one request (keys: the prompt's block keys, in order;
    tokens; node ids to avoid; decode_only: the prefill already ran, choose a decode node)."""

    rid: str
    keys: tuple[bytes, ...]
    prompt_tokens: int
    max_new_tokens: int = 0
    exclude: tuple[str, ...] = ()
    decode_only: bool = False

    def to_json(self) -> dict:
        return {"rid": self.rid, "keys": hex_keys(self.keys), "prompt_tokens": self.prompt_tokens,
                "max_new_tokens": self.max_new_tokens, "exclude": list(self.exclude),
                "decode_only": self.decode_only}

    @classmethod
    def from_json(cls, d: Any) -> PlaceRequest:
        exclude = _get(d, "exclude", list, [])
        if not all(isinstance(x, str) for x in exclude):
            raise MessageError("field 'exclude': expected node ids")
        return cls(_get(d, "rid", str, ""), unhex_keys(_get(d, "keys", list, [])),
                   _get(d, "prompt_tokens", int, 0), _get(d, "max_new_tokens", int, 0),
                   tuple(exclude), _get(d, "decode_only", bool, False))


@dataclass(frozen=True)
class PlaceReply:
    """A placement: the prefill and decode nodes, what to fetch, tokens reused (all, and
    already on the prefill node) and the conductor's predictions (seconds)."""

    prefill: NodeRef
    decode: NodeRef
    fetch: FetchPlan | None
    prefix_tokens: int
    local_prefix_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float

    def to_json(self) -> dict:
        return {"ok": True, "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
                "fetch": self.fetch.to_json() if self.fetch is not None else None,
                "prefix_tokens": self.prefix_tokens,
                "local_prefix_tokens": self.local_prefix_tokens,
                "predicted_ttft_s": self.predicted_ttft_s, "predicted_tbt_s": self.predicted_tbt_s}


@dataclass(frozen=True)
class PlaceRejected:
    """An early rejection (HTTP 429, or 503 for a "no_..." reason) and when to retry; for
    reason "ttft_slo_unattainable" (over the TTFT SLO even on an idle cluster: HTTP 400,
    no retry) `max_prompt_tokens`, the longest prompt that would meet it."""

    reason: str
    retry_after_s: float
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    detail: str | None = None       # e.g. "prefill0 is draining" for a no_... reason
    max_prompt_tokens: int | None = None

    def to_json(self) -> dict:
        return {"ok": False, "reason": self.reason, "retry_after_s": self.retry_after_s,
                "predicted_ttft_s": self.predicted_ttft_s, "predicted_tbt_s": self.predicted_tbt_s,
                "detail": self.detail, "max_prompt_tokens": self.max_prompt_tokens}


def place_result_from_json(d: Any) -> PlaceReply | PlaceRejected:
    """The answer of `conductor.place`. Raises: MessageError for a malformed answer."""
    if not _get(d, "ok", bool):
        return PlaceRejected(_get(d, "reason", str), _get(d, "retry_after_s", float),
                             _get(d, "predicted_ttft_s", float, None),
                             _get(d, "predicted_tbt_s", float, None),
                             _get(d, "detail", str, None), _get(d, "max_prompt_tokens", int, None))
    fetch = d.get("fetch")
    return PlaceReply(NodeRef.from_json(_get(d, "prefill", dict)),
                      NodeRef.from_json(_get(d, "decode", dict)),
                      FetchPlan.from_json(fetch) if fetch is not None else None,
                      _get(d, "prefix_tokens", int), _get(d, "local_prefix_tokens", int, 0),
                      _get(d, "predicted_ttft_s", float), _get(d, "predicted_tbt_s", float))


# ---------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class OutputDelta:
    """One RequestOutput delta between nodes (the prefill's first token; each line of the
    decode stream): new token ids and text, their logprobs, finish state, token counts."""

    ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    emitted_s: float | None = None    # time.time() when the engine emitted it (relay delay)
    # the prompt's scored tokens (SamplingParams.prompt_logprobs), on the first delta only
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        """The delta of an engine RequestOutput."""
        return cls(tuple(out.new_token_ids), out.new_text,
                   tuple(out.logprobs) if out.logprobs else None, out.finished,
                   out.finish_reason, out.stop_reason, out.num_output_tokens,
                   out.num_cached_tokens, out.error, out.emitted_s,
                   None if out.prompt_logprobs is None else tuple(out.prompt_logprobs))

    def to_json(self) -> dict:
        lps = None if not self.logprobs else [logprob_to_json(lp) for lp in self.logprobs]
        return {"ids": list(self.ids), "text": self.text, "logprobs": lps,
                "finished": self.finished, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason, "num_output_tokens": self.num_output_tokens,
                "num_cached_tokens": self.num_cached_tokens, "error": self.error,
                "emitted_s": self.emitted_s,
                "prompt_logprobs": prompt_logprobs_to_json(self.prompt_logprobs)}

    @classmethod
    def from_json(cls, d: Any) -> OutputDelta:
        raw = _get(d, "logprobs", list, None)
        lps = None if not raw else tuple(logprob_from_json(v) for v in raw)
        stop = d.get("stop_reason") if isinstance(d, Mapping) else None
        if stop is not None and not isinstance(stop, (str, int)):
            raise MessageError("field 'stop_reason': expected a string or a token id")
        return cls(_ints(_get(d, "ids", list), "ids"), _get(d, "text", str), lps,
                   _get(d, "finished", bool), _get(d, "finish_reason", str, None), stop,
                   _get(d, "num_output_tokens", int, 0), _get(d, "num_cached_tokens", int, 0),
                   _get(d, "error", str, None), _get(d, "emitted_s", float, None),
                   prompt_logprobs_from_json(_get(d, "prompt_logprobs", list, None)))

    def to_output(self, rid: str, ids: Sequence[int] | None = None, text: str | None = None
                  ) -> RequestOutput:
        """A RequestOutput for rid (ids and text replaced when given)."""
        return RequestOutput(rid, list(self.ids if ids is None else ids),
                             self.text if text is None else text, self.finished,
                             self.finish_reason, self.stop_reason,
                             list(self.logprobs) if self.logprobs else None,
                             num_cached_tokens=self.num_cached_tokens,
                             num_output_tokens=self.num_output_tokens, error=self.error,
                             emitted_s=self.emitted_s,
                             prompt_logprobs=(None if self.prompt_logprobs is None
                                              else list(self.prompt_logprobs)))


@dataclass(frozen=True)
class DecodeFailure:
    """A decode-stream line that ends the request: the error, its HTTP status (400 for a
    request the engine refuses, 500 otherwise) and the parameter at fault."""

    error: str
    status: int
    param: str | None = None

    def to_json(self) -> dict:
        return {"failure": {"error": self.error, "status": self.status, "param": self.param}}

    @classmethod
    def from_line(cls, d: Any) -> DecodeFailure | None:
        """The failure a stream line carries, or None for an output line."""
        f = d.get("failure") if isinstance(d, Mapping) else None
        if f is None:
            return None
        return cls(_get(f, "error", str), _get(f, "status", int), _get(f, "param", str, None))


# ---------------------------------------------------------------------------- KV hand-over


@dataclass(frozen=True)
class KVHandle:
    """Where a request's KV is after its prefill: the stage segment's descriptor on the
    prefill node (layer-major [layers, blocks, 2, block_size, kv_heads, head_dim], dtype),
    tokens it covers, and whether it was pushed into the decode node's receive buffer
    (then `push` holds the PushStats)."""

    descriptor: dict
    shape: tuple[int, ...]
    dtype: str
    num_tokens: int
    pushed: bool = False
    push: dict | None = None

    def to_json(self) -> dict:
        return {"descriptor": self.descriptor, "shape": list(self.shape), "dtype": self.dtype,
                "num_tokens": self.num_tokens, "pushed": self.pushed, "push": self.push}

    @classmethod
    def from_json(cls, d: Any) -> KVHandle:
        return cls(_get(d, "descriptor", dict), _ints(_get(d, "shape", list), "shape"),
                   _get(d, "dtype", str), _get(d, "num_tokens", int),
                   _get(d, "pushed", bool, False), _get(d, "push", dict, None))


@dataclass(frozen=True)
class PrefillRequest:
    """`node.prefill`: prefill `prompt` (token ids) with max_tokens=1 after fetching the
    planned prefix; with `stage`, keep the KV staged layer by layer, and with `push_to` (a
    decode node's control address) WRITE each layer there; `ttl_s`: the request's time left.
    `admit_at`: the decode node (control address) that must admit the request (its TBT
    check, `KVReservation.admit_tokens`) before the prefill computes, or None."""

    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None
    fetch: FetchPlan | None = None
    prefix_tokens: int = 0
    stage: bool = False
    push_to: str | None = None
    ttl_s: float = 0.0
    admit_at: str | None = None

    def to_json(self) -> dict:
        return {"rid": self.rid, "prompt": list(self.prompt),
                "params": params_to_json(self.params), "cache_salt": self.cache_salt,
                "fetch": self.fetch.to_json() if self.fetch is not None else None,
                "prefix_tokens": self.prefix_tokens, "stage": self.stage,
                "push_to": self.push_to, "ttl_s": self.ttl_s, "admit_at": self.admit_at}

    @classmethod
    def from_json(cls, d: Any) -> PrefillRequest:
        fetch = _get(d, "fetch", dict, None)
        return cls(_get(d, "rid", str), _ints(_get(d, "prompt", list), "prompt"),
                   params_from_json(_get(d, "params", dict)), _get(d, "cache_salt", str, None),
                   FetchPlan.from_json(fetch) if fetch is not None else None,
                   _get(d, "prefix_tokens", int, 0), _get(d, "stage", bool, False),
                   _get(d, "push_to", str, None), _get(d, "ttl_s", float, 0.0),
                   _get(d, "admit_at", str, None))


@dataclass(frozen=True)
class PrefillReply:
    """The answer of `node.prefill`: the first token, where the KV is (None when the request
    finished with its first token), and the prefill's wall time (seconds)."""

    output: OutputDelta
    kv: KVHandle | None
    seconds: float

    def to_json(self) -> dict:
        return {"output": self.output.to_json(),
                "kv": self.kv.to_json() if self.kv is not None else None, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: Any) -> PrefillReply:
        kv = _get(d, "kv", dict, None)
        return cls(OutputDelta.from_json(_get(d, "output", dict)),
                   KVHandle.from_json(kv) if kv is not None else None, _get(d, "seconds", float))


@dataclass(frozen=True)
class KVReservation:
    """`node.kv_reserve`: a receive buffer on a decode node for one request's pushed KV
    (layer-major shape, dtype), owned by the prefill node at control address `owner`, for
    at most ttl_s seconds. With `admit_tokens` (the prompt's tokens) the decode node first
    admits the request (its TBT check: DecodeRefused, before the prefill computes); an
    empty shape asks for the admission only (no push)."""

    rid: str
    owner: str
    shape: tuple[int, ...]
    dtype: str
    ttl_s: float = 0.0
    admit_tokens: int = 0

    def to_json(self) -> dict:
        return {"rid": self.rid, "owner": self.owner, "shape": list(self.shape),
                "dtype": self.dtype, "ttl_s": self.ttl_s, "admit_tokens": self.admit_tokens}

    @classmethod
    def from_json(cls, d: Any) -> KVReservation:
        return cls(_get(d, "rid", str), _get(d, "owner", str, ""),
                   _ints(_get(d, "shape", list), "shape"), _get(d, "dtype", str),
                   _get(d, "ttl_s", float, 0.0), _get(d, "admit_tokens", int, 0))


@dataclass(frozen=True)
class KVReserved:
    """The reserved buffer's segment descriptor (its access key goes to the owner only)."""

    descriptor: dict

    def to_json(self) -> dict:
        return {"descriptor": self.descriptor}

    @classmethod
    def from_json(cls, d: Any) -> KVReserved:
        return cls(_get(d, "descriptor", dict))


@dataclass(frozen=True)
class Release:
    """`node.release`: free rid's staged KV, or (with `owner`) the receive buffer that owner
    reserved for rid."""

    rid: str
    owner: str | None = None

    def to_json(self) -> dict:
        return {"rid": self.rid, "owner": self.owner}

    @classmethod
    def from_json(cls, d: Any) -> Release:
        return cls(_get(d, "rid", str), _get(d, "owner", str, None))


@dataclass(frozen=True)
class DecodeRequest:
    """POST /internal/decode: admit a prefilled request (prompt token ids, the prefill's
    first token) with its KV, from the prefill node at control address `prefill`."""

    rid: str
    prompt: tuple[int, ...]
    first_token: int
    params: SamplingParams
    kv: KVHandle
    prefill: str
    cache_salt: str | None = None

    def to_json(self) -> dict:
        return {"rid": self.rid, "prompt": list(self.prompt), "first_token": self.first_token,
                "params": params_to_json(self.params), "kv": self.kv.to_json(),
                "prefill": self.prefill, "cache_salt": self.cache_salt}

    @classmethod
    def from_json(cls, d: Any) -> DecodeRequest:
        return cls(_get(d, "rid", str), _ints(_get(d, "prompt", list), "prompt"),
                   _get(d, "first_token", int), params_from_json(_get(d, "params", dict)),
                   KVHandle.from_json(_get(d, "kv", dict)), _get(d, "prefill", str, ""),
                   _get(d, "cache_salt", str, None))


@dataclass(frozen=True)
class GenerateRequest:
    """POST /internal/generate on a coupled node (role all, cluster.coupled): run the whole
    request (prefill and decode in one engine) and stream OutputDelta lines back."""

    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None

    def to_json(self) -> dict:
        return {"rid": self.rid, "prompt": list(self.prompt),
                "params": params_to_json(self.params), "cache_salt": self.cache_salt}

    @classmethod
    def from_json(cls, d: Any) -> GenerateRequest:
        return cls(_get(d, "rid", str), _ints(_get(d, "prompt", list), "prompt"),
                   params_from_json(_get(d, "params", dict)), _get(d, "cache_salt", str, None))


# ---------------------------------------------------------------------------- reports


MAX_STAGE_CHUNKS = 1024   # chunk times per stage a PrefillDone carries (8k tokens / 8-token chunks)


@dataclass(frozen=True)
class PrefillDone:
    """A finished prefill: wall seconds, new and cached tokens, and whether it ran alone
    on its node (only those are refit samples). A CPP group's stage 0 adds `stages`: per
    stage in stage order, each chunk's compute seconds in chunk order (the conductor
    learns per-stage step times from them, cpp_place.GroupLearner); () otherwise."""

    rid: str
    seconds: float
    new: int
    cached: int
    alone: bool
    stages: tuple[tuple[float, ...], ...] = ()

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.stages:
            del d["stages"]          # a plain prefill node's report stays as it was
        return d

    @classmethod
    def from_json(cls, d: Any) -> PrefillDone:
        raw = _get(d, "stages", list, [])
        if not all(isinstance(st, list) and len(st) <= MAX_STAGE_CHUNKS and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in st)
                for st in raw) or len(raw) > MAX_STAGE_CHUNKS:
            raise MessageError(f"field 'stages': expected lists of at most {MAX_STAGE_CHUNKS} "
                               f"non-negative seconds")
        return cls(_get(d, "rid", str, ""), _get(d, "seconds", float), _get(d, "new", int, 0),
                   _get(d, "cached", int, 0), _get(d, "alone", bool, False),
                   tuple(tuple(float(x) for x in st) for st in raw))


@dataclass(frozen=True)
class StoreEventMsg:
    """A store event on the wire: keys stored into or evicted from one tier, with its seq."""

    kind: str
    tier: str
    seq: int
    keys: tuple[bytes, ...]

    def to_json(self) -> dict:
        return {"kind": self.kind, "tier": self.tier, "seq": self.seq, "keys": hex_keys(self.keys)}

    @classmethod
    def from_json(cls, d: Any) -> StoreEventMsg:
        return cls(_get(d, "kind", str), _get(d, "tier", str), _get(d, "seq", int),
                   unhex_keys(_get(d, "keys", list)))


@dataclass(frozen=True)
class DecodeLoad:
    """A decode node's load: running request ids, batch size, KV tokens they hold and KV
    room left (tokens)."""

    rids: tuple[str, ...] = ()
    batch: int = 0
    context_tokens: int = 0
    free_kv_tokens: int = 0

    def to_json(self) -> dict:
        return {"rids": list(self.rids), "batch": self.batch,
                "context_tokens": self.context_tokens, "free_kv_tokens": self.free_kv_tokens}

    @classmethod
    def from_json(cls, d: Any) -> DecodeLoad:
        return cls(tuple(_get(d, "rids", list, [])), _get(d, "batch", int, 0),
                   _get(d, "context_tokens", int, 0), _get(d, "free_kv_tokens", int, 0))


@dataclass(frozen=True)
class NodeReport:
    """`conductor.report`, every cluster.report_interval_s: load (prefills pending as
    rid -> (new, cached) tokens, decode load), requests that arrived, store events after
    `store_seq`, finished prefills and timed decode steps ((batch, context tokens,
    seconds)); `waiting`: the pending prefills not computing yet (fetching, or held back
    by the node's spf queue); `prefill_steps`: timed steps of prefill chunks only ((new
    tokens, tokens cached before them, seconds): the conductor calibrates from them);
    `links`: what its transfer engine measured on each peer path, peer node id -> bytes/s
    (transfer/bandwidth.py): the transfers this node started with the peer, READs (bytes
    peer -> node: a prefill node's prefix fetches, a decode node's READ of staged KV, a
    replica's copy) and WRITEs (node -> peer: a prefill node's KV push to its decode
    node, a CPP stage's hidden states) together (ConductorService.path_rates);
    `stalled`: why the node cannot take a request now ("" when it can: a CPP stage whose
    slots are all held without progress, or hung); `ttfts`: (rid, seconds) of the requests
    whose first token this node's API front end sent since the last report, from the
    request's arrival there (the conductor learns the TTFT overhead from them); `tbts`:
    (rid, seconds) of the requests this node's API front end finished since the last
    report, each its TBT as sent to the client (measures.tbt_s: the conductor learns the
    TBT factor from them)."""

    node: str
    role: str = ""
    draining: bool = False
    pending: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    arrived: tuple[str, ...] = ()
    decode: DecodeLoad = DecodeLoad()
    store_seq: int = -1
    events: tuple[StoreEventMsg, ...] = ()
    done: tuple[PrefillDone, ...] = ()
    decode_steps: tuple[tuple[int, int, float], ...] = ()
    waiting: tuple[str, ...] = ()
    prefill_steps: tuple[tuple[int, int, float], ...] = ()
    links: Mapping[str, float] = dataclasses.field(default_factory=dict)
    stalled: str = ""
    ttfts: tuple[tuple[str, float], ...] = ()
    tbts: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict:
        return {"node": self.node, "role": self.role, "draining": self.draining,
                "links": dict(self.links), "stalled": self.stalled,
                "ttfts": [[rid, s] for rid, s in self.ttfts],
                "tbts": [[rid, s] for rid, s in self.tbts],
                "pending": {rid: list(v) for rid, v in self.pending.items()},
                "waiting": list(self.waiting),
                "arrived": list(self.arrived), "decode": self.decode.to_json(),
                "store_seq": self.store_seq, "events": [e.to_json() for e in self.events],
                "done": [x.to_json() for x in self.done],
                "decode_steps": [list(s) for s in self.decode_steps],
                "prefill_steps": [list(s) for s in self.prefill_steps]}

    @classmethod
    def from_json(cls, d: Any) -> NodeReport:
        try:
            pending = {str(rid): (int(a), int(b))
                       for rid, (a, b) in _get(d, "pending", dict, {}).items()}
            steps = tuple((int(b), int(c), float(s)) for b, c, s in
                          _get(d, "decode_steps", list, []))
            psteps = tuple((int(n), int(c), float(s)) for n, c, s in
                           _get(d, "prefill_steps", list, []))
            links = {str(p): float(r) for p, r in _get(d, "links", dict, {}).items()}
            ttfts = tuple((str(rid), float(s)) for rid, s in _get(d, "ttfts", list, []))
            tbts = tuple((str(rid), float(s)) for rid, s in _get(d, "tbts", list, []))
        except (TypeError, ValueError) as e:
            raise MessageError(f"report: {e}") from None
        return cls(_get(d, "node", str), _get(d, "role", str, ""),
                   _get(d, "draining", bool, False), pending,
                   tuple(_get(d, "arrived", list, [])),
                   DecodeLoad.from_json(_get(d, "decode", dict, {})),
                   _get(d, "store_seq", int, -1),
                   tuple(StoreEventMsg.from_json(e) for e in _get(d, "events", list, [])),
                   tuple(PrefillDone.from_json(x) for x in _get(d, "done", list, [])), steps,
                   tuple(str(r) for r in _get(d, "waiting", list, [])), psteps, links,
                   _get(d, "stalled", str, ""), ttfts, tbts)


# ---- chunked pipeline parallelism: a CPP group's stages (cluster/cpp/pipeline_stage.py)


def _opt_object(d: Any, name: str) -> dict | None:
    """An optional JSON-object field (kept as a dict: its parts are read where they are
    used). Raises: MessageError when present and not an object."""
    v = _get(d, name, dict, None)
    return None if v is None else dict(v)


@dataclass(frozen=True)
class CppPrefill:
    """`cpp.prefill` on stage 0: run `token_ids` through the group in chunks of
    `chunk_tokens`; the last stage picks the first token.

    Attributes:
        request_id: the request's id.
        token_ids: the prompt (vocabulary ids).
        chunk_tokens: tokens per pipeline chunk (>= 1, checked by the stage).
        keep: keep the request's pages on every stage after it finishes (tests, bench).
        kv_target: {"descriptor": ...}, the decode node's layer-major receive buffer that
            every stage pushes its layers' KV into, or None.
        sampling: {"params": SamplingParams JSON, "prompt": ids} for the last stage's pick,
            or None (greedy argmax).
        keys: the prompt's block keys (store/keys.py) for the stages' prefix caches.
        fetch: {"control": addr, "blocks": n}: a node holding the prefix's full blocks.
    """

    request_id: str
    token_ids: tuple[int, ...]
    chunk_tokens: int = 512
    keep: bool = False
    kv_target: dict | None = None
    sampling: dict | None = None
    keys: tuple[bytes, ...] = ()
    fetch: dict | None = None

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "token_ids": list(self.token_ids),
                "chunk_tokens": self.chunk_tokens, "keep": self.keep,
                "kv_target": self.kv_target, "sampling": self.sampling,
                "keys": hex_keys(self.keys), "fetch": self.fetch}

    @classmethod
    def from_json(cls, d: Any) -> CppPrefill:
        return cls(_get(d, "request_id", str), _ints(_get(d, "token_ids", list), "token_ids"),
                   _get(d, "chunk_tokens", int, 512), _get(d, "keep", bool, False),
                   _opt_object(d, "kv_target"), _opt_object(d, "sampling"),
                   unhex_keys(_get(d, "keys", list, [])), _opt_object(d, "fetch"))


@dataclass(frozen=True)
class CppReserve:
    """`cpp.reserve` from stage k on stage k+1: a receive slot for `num_tokens` hidden-state
    rows of the request, and (with `keys`) the prefix match down the chain. The other
    fields travel on from stage 0's CppPrefill."""

    request_id: str
    num_tokens: int
    keep: bool = False
    kv_target: dict | None = None
    sampling: dict | None = None
    keys: tuple[bytes, ...] = ()
    fetch: dict | None = None

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "num_tokens": self.num_tokens, "keep": self.keep,
                "kv_target": self.kv_target, "sampling": self.sampling,
                "keys": hex_keys(self.keys), "fetch": self.fetch}

    @classmethod
    def from_json(cls, d: Any) -> CppReserve:
        return cls(_get(d, "request_id", str), _get(d, "num_tokens", int),
                   _get(d, "keep", bool, False), _opt_object(d, "kv_target"),
                   _opt_object(d, "sampling"), unhex_keys(_get(d, "keys", list, [])),
                   _opt_object(d, "fetch"))


@dataclass(frozen=True)
class CppChunk:
    """`cpp.chunk` from stage k on stage k+1: hidden-state rows start..end-1 of the request
    are in its receive slot; `last` for the prompt's final chunk (the call then answers
    with the request's result)."""

    request_id: str
    start: int
    end: int
    last: bool

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "start": self.start, "end": self.end,
                "last": self.last}

    @classmethod
    def from_json(cls, d: Any) -> CppChunk:
        return cls(_get(d, "request_id", str), _get(d, "start", int), _get(d, "end", int),
                   _get(d, "last", bool))


@dataclass(frozen=True)
class CppRequestRef:
    """`cpp.hold` (kept open for the request's life: the upstream stage is alive) and
    `cpp.release` (free it): the request's id only."""

    request_id: str

    def to_json(self) -> dict:
        return {"request_id": self.request_id}

    @classmethod
    def from_json(cls, d: Any) -> CppRequestRef:
        return cls(_get(d, "request_id", str))


__all__ = ["CppChunk", "CppPrefill", "CppRequestRef", "CppReserve", "DecodeFailure",
           "DecodeLoad", "DecodeRequest", "FetchPlan", "KVHandle", "KVReservation", "KVReserved", "MessageError", "NodeRef", "NodeReport", "OutputDelta",
           "PlaceRejected", "PlaceReply", "PlaceRequest", "PrefillDone", "PrefillReply",
           "PrefillRequest", "Release", "StoreEventMsg", "float_from_json", "float_to_json",
           "hex_keys", "logprob_from_json", "logprob_to_json", "params_from_json",
           "prompt_logprobs_from_json", "prompt_logprobs_to_json",
           "params_to_json", "place_result_from_json", "unhex_keys"]
