"""Constrained decoding (structured outputs) through xgrammar: the one module that knows it.

A request's `SamplingParams.structured` (a StructuredSpec: JSON schema, any JSON object,
regex, choice or EBNF grammar) becomes an xgrammar grammar, compiled once per spec against
the engine's vocabulary and cached. Each constrained request owns a `GrammarMatcher`
(Sequence.grammar); every step the runner fills one token bitmask row per constrained row of
the batch on a helper thread while the forward pass runs (`start_masks`) and masks the
logits before sampling (`apply_masks`), and the engine advances the
matcher over each accepted token (`accept`). On a decode node the matcher is re-created from
the spec and advanced over the tokens the prefill node sampled: the spec crosses nodes, the
matcher state never does.

Why xgrammar (0.2.9), not llguidance (1.9.1): both install as wheels against torch 2.13 CPU
and both build their vocabulary from our GGUF-loaded tokenizer (byte-level BPE, 49152
tokens; checked). xgrammar is vLLM's and SGLang's default backend, so the grammars a client
gets (JSON-schema coverage, strict mode, error cases) match what those servers give it; it
ships a CPU bitmask kernel for torch logits and a batched matcher that fills a batch's
masks on its own threads, and its compiler caches compiled grammars.

JSON is generated compact (`any_whitespace=False`, vLLM's `disable_any_whitespace`): a small
model left free to emit whitespace between tokens tends to loop on it until max_tokens.
Schemas use xgrammar's strict mode (vLLM's default): additionalProperties defaults to false.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .types import InvalidRequest, StructuredSpec

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept per engine (each holds a per-token mask cache: tens of KB to MBs).
CACHE_SIZE = 256
_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")   # "[03:33:42] /project/cpp/x.cc:94: "


def _xgr():
    import xgrammar  # 1.4 s import: only when a constraint is used
    return xgrammar


def _clean(e: Exception) -> str:
    """xgrammar's C++ error text without its timestamp and source-file prefix."""
    return _ERROR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def spec_for_json_schema(schema: Any) -> StructuredSpec:
    """A "json" StructuredSpec from a schema (dict/bool, or JSON text), re-serialised compactly
    (key order kept: it is the order the properties are generated in), so the same schema
    sent as text or as an object shares one cache entry. Raises InvalidRequest for
    unparsable text or a non-object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("a JSON schema must be an object", "json_schema")
    return StructuredSpec("json", json.dumps(schema, separators=(",", ":")))


def spec_for_choice(choices: list[str]) -> StructuredSpec:
    """A "choice" StructuredSpec: the output is exactly one of `choices` (non-empty strings)."""
    return StructuredSpec("choice", json.dumps(list(choices)))


# JSON Schema keywords xgrammar 0.2.9 accepts but does not enforce (probed: a grammar built
# with them accepts instances they forbid). A schema using one is refused, not half-obeyed.
UNENFORCED = ("not", "allOf", "if", "then", "else", "dependentRequired", "dependentSchemas",
              "uniqueItems", "contains", "minContains", "maxContains")
# String formats xgrammar enforces (the others it ignores).
FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6",
                     "hostname", "uri", "uri-reference", "uri-template", "json-pointer",
                     "relative-json-pointer"))
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties",
               "additionalItems", "unevaluatedItems")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems", "items")


def schema_location(path: Sequence[str | int]) -> str:
    """Where in a JSON schema `path` (keys and indices from the root) points, for an error
    message: "the schema root", or a JSON pointer as a URI fragment (RFC 6901, escaping
    "~" as "~0" and "/" as "~1"), e.g. "#/properties/a~1b"."""
    if not path:
        return "the schema root"
    return "#/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _regex_error(pattern: str) -> str | None:
    """Why xgrammar cannot enforce `pattern` as a regex (lookarounds, backreferences,
    Unicode classes, inline flags: its regex converter refuses them, while inside a JSON
    schema it would silently drop the pattern), or None when it can."""
    try:
        _regex_grammar(pattern)
    except (RuntimeError, ValueError) as e:
        return _clean(e)
    return None


@functools.lru_cache(maxsize=CACHE_SIZE)
def _regex_grammar(pattern: str) -> Any:
    return _xgr().Grammar.from_regex(pattern)


def unsupported(schema: Any, path: tuple[str | int, ...] = ()) -> str | None:
    """Where and what the first construct is that the grammar could not enforce, or None.

    Walks every subschema (properties, $defs, items, anyOf, ...); `path` is where `schema`
    sits in the document (see `schema_location`). Refused: the keywords in UNENFORCED, a
    `format` outside FORMATS, a `$ref` outside the document, `minLength`/`maxLength`
    beside a `pattern` (xgrammar drops them), and a `pattern` (or `patternProperties`
    key) xgrammar's regex converter refuses (it would drop it from a schema: issue 32).
    """
    if not isinstance(schema, dict):
        return None
    where = schema_location(path)
    for k in UNENFORCED:
        if k in schema:
            return f"'{k}' at {where} is not supported"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        lengths = [k for k in ("minLength", "maxLength") if k in schema]
        if lengths:      # xgrammar 0.2.9 drops the lengths beside a pattern (it logs so)
            return (f"'{lengths[0]}' beside 'pattern' at {where} is not supported (the grammar "
                    f"would ignore it): put the length into the pattern, e.g. {{m,n}}")
        if (why := _regex_error(pattern)) is not None:
            return f"'pattern' {pattern!r} at {where} is not supported: {why}"
    if isinstance(schema.get("patternProperties"), dict):
        for name in schema["patternProperties"]:
            if (why := _regex_error(name)) is not None:
                return f"'patternProperties' key {name!r} at {where} is not supported: {why}"
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        return f"format {fmt!r} at {where} is not supported (supported: {', '.join(sorted(FORMATS))})"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref {ref!r} at {where} is not supported (only references inside the schema)"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (why := unsupported(sub, (*path, key, name))) is not None:
                    return why
    for key in _SCHEMA_ONE:
        if (why := unsupported(schema.get(key), (*path, key))) is not None:
            return why
    for key in _SCHEMA_LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if (why := unsupported(sub, (*path, key, i))) is not None:
                    return why
    return None


def _check_schema(text: str) -> None:
    """Raises InvalidRequest for a schema that is not valid JSON Schema (checked against its
    meta-schema by `jsonschema`, draft 2020-12 unless $schema says otherwise) or that uses a
    construct the grammar cannot enforce."""
    import jsonschema  # only for requests with a schema

    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidRequest(f"invalid JSON schema at {schema_location(e.path)}: {e.message}",
                             "structured_outputs") from None
    why = unsupported(schema)
    if why is not None:
        raise InvalidRequest(f"unsupported JSON schema construct: {why}", "structured_outputs")


# xgrammar 0.2.9 renders a string with minLength/maxLength (and no pattern) as `"\"" X{m,n}
# "\""` with X ::= [^"\\\r\n]: raw tabs and other control characters (invalid JSON) and no
# escapes (issue 32, fault 3; xgrammar #800). Such rules are rewritten to a JSON string
# character: any but '"', '\\' and U+0000-U+001F, or an escape (one character of the length).
_LENGTH_CHARS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = (r'(([^\"\\\0-\x1f]) | ("\\" mooncaked_json_escape))')
_JSON_ESCAPE = (r'mooncaked_json_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] '
                r'[A-Fa-f0-9] [A-Fa-f0-9]))')


def length_bounded_strings(g: Any) -> Any:
    """`g` (a Grammar from a JSON schema) with every length-bounded string's characters
    made JSON string characters (see _LENGTH_CHARS): no raw control character, escapes
    allowed, each counting as one character. `g` itself when it has no such string."""
    text, n = _LENGTH_CHARS.subn(lambda m: f"{m.group(1)} ::= {_JSON_CHAR}", str(g))
    if not n:
        return g
    return _xgr().Grammar.from_ebnf(f"{text}\n{_JSON_ESCAPE}\n")


def _choice_ebnf(value: str) -> str:
    choices = json.loads(value)
    # EBNF string literals take JSON's escapes; one alternative per choice.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=CACHE_SIZE)
def grammar(spec: StructuredSpec) -> xgr.Grammar:
    """The xgrammar Grammar of a spec (vocabulary-independent; cached).

    Raises: InvalidRequest naming the problem (a schema that is not valid JSON Schema, a
        construct xgrammar would not enforce (`unsupported`), one it rejects, a regex or EBNF
        syntax error), param "structured_outputs".
    """
    xgr = _xgr()
    try:
        if spec.kind == "json":
            _check_schema(spec.value)
            return length_bounded_strings(
                xgr.Grammar.from_json_schema(spec.value, any_whitespace=False))
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.value))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
    except InvalidRequest:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "json_object": "JSON object"}[spec.kind]
        raise InvalidRequest(f"invalid or unsupported {what}: {_clean(e)}",
                             "structured_outputs") from None
    raise InvalidRequest(f"unknown constraint kind {spec.kind!r}", "structured_outputs")


def check_spec(spec: StructuredSpec) -> None:
    """Checks a spec before a request is admitted (the API's 400), without a tokenizer.

    Raises: InvalidRequest naming the problem.
    """
    grammar(spec)


class GrammarBackend:
    """One engine's grammar compiler: its vocabulary, compiled-grammar cache, matchers.

    Args:
        hf_tokenizer: the transformers tokenizer of the model (byte-level BPE pieces).
        vocab_size: width of the model's logits (tokens), >= the tokenizer's size.
        stop_token_ids: the tokens that end a request (EOS); a grammar ends on one of them.
    The vocabulary is built on first use (about 0.1 s for 49k tokens).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self._hf, self.vocab_size, self.stop_token_ids = hf_tokenizer, vocab_size, stop_token_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0               # grammars compiled (a cache miss each)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compiled(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The spec's grammar compiled for this vocabulary; LRU-cached per spec.

        Raises: InvalidRequest for an invalid spec (see `grammar`)."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            g = self._get_compiler().compile_grammar(grammar(spec))
            self.compiles += 1
            self._compiled[spec] = g
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return g

    def matcher(self, spec: StructuredSpec, tokens_so_far: list[int] = ()) -> xgr.GrammarMatcher:
        """A fresh matcher for `spec`, advanced over `tokens_so_far` (output tokens another
        node already sampled under the same spec).

        Raises: InvalidRequest for an invalid spec, or when a token breaks the constraint.
        """
        m = _xgr().GrammarMatcher(self.compiled(spec), override_stop_tokens=self.stop_token_ids)
        for t in tokens_so_far:
            if not m.accept_token(int(t)):
                raise InvalidRequest(f"token {t} does not follow the request's constraint",
                                     "structured_outputs")
        return m


Masks = tuple[torch.Tensor, list[int]]


def fill_masks(matchers: list[xgr.GrammarMatcher | None], vocab_size: int) -> Masks:
    """The next-token masks of a batch's rows: (int32 bitmask [N, ceil(vocab_size / 32)],
    indices of the constrained rows). matchers: N entries, None for an unconstrained row.

    All constrained rows are filled in one batched call (xgrammar's BatchGrammarMatcher,
    on its own threads). Reads the matchers only, so it may run while the forward pass
    does (`start_masks`), since matchers advance only after sampling.
    """
    idx = [i for i, m in enumerate(matchers) if m is not None]
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    if len(idx) == 1:
        matchers[idx[0]].fill_next_token_bitmask(bitmask, idx[0])
    elif idx:
        _batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in idx], bitmask, idx)
    return bitmask, idx


_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")


def start_masks(matchers: list[xgr.GrammarMatcher | None], vocab_size: int) -> Future[Masks]:
    """`fill_masks` on a helper thread, so it overlaps the step's forward pass (the model's
    torch ops release the GIL). Returns its Future."""
    return _pool.submit(fill_masks, matchers, vocab_size)


def apply_masks(logits: torch.Tensor, masks: Masks) -> None:
    """Masks, in place, every token a row's grammar forbids next (logit -> -inf).

    logits: fp32 [N, vocab] logits of the rows about to be sampled, in the order of the
    matchers the masks were filled from (xgrammar's CPU kernel).
    """
    bitmask, idx = masks
    if idx:
        _xgr().apply_token_bitmask_inplace(logits, bitmask, indices=idx)


def mask_logits(logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> None:
    """fill_masks + apply_masks in one call (no overlap). logits: fp32 [N, vocab]."""
    apply_masks(logits, fill_masks(matchers, logits.shape[-1]))


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return _xgr().BatchGrammarMatcher()


def grammar_accept(matcher: xgr.GrammarMatcher, token: int) -> bool:
    """Advances a matcher over an accepted token; True when the token was allowed."""
    return bool(matcher.accept_token(int(token)))


def grammar_finished(matcher: xgr.GrammarMatcher) -> bool:
    """True once the grammar has ended (it accepted a stop token)."""
    return bool(matcher.is_terminated())
