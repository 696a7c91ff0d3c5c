"""Structured outputs and tool calls at the API: request fields -> a StructuredSpec, and
constrained output text -> OpenAI `tool_calls`.

Request fields (OpenAI API reference "Structured Outputs" and "Function calling"; vLLM
"Structured Outputs"):
- `response_format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (chat and completions). Every schema is
  enforced, strict or not (as vLLM does).
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"}, its
  current name (vLLM >= 0.10.2). The older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` (removed from vLLM in 0.12) are accepted too, for older clients.
- `tools` + `tool_choice` (chat): "none" (no constraint), "required" (a JSON array of one or
  more {"name", "parameters"} calls, as vLLM constrains it), a named function {"type":
  "function", "function": {"name"}} (the output is that function's arguments object), and
  "auto" (the default when tools are given), which needs a chat template with a tool format
  and is otherwise a 400. Tool definitions reach the prompt through the chat template when
  it accepts them.
At most one constraint per request; a schema, regex or grammar the grammar library cannot
use is a 400 naming the problem (engine/structured.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mooncaked.engine.structured import (
    check_spec,
    spec_for_choice,
    spec_for_json_schema,
)
from mooncaked.engine.types import InvalidRequest, StructuredSpec

from .errors import ApiError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")          # OpenAI's function / schema names
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_SO_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a chat request uses its tools.

    mode: "none" | "auto" | "required" | "named"; name: the function for "named";
    tools: the OpenAI tool definitions (for the chat template).
    """

    mode: str
    name: str | None = None
    tools: list[dict] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        """True when the output is a tool call by construction (required / named)."""
        return self.mode in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        """True when the output is turned into tool_calls (every mode but "none")."""
        return self.mode != "none"


def _bad(message: str, param: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _checked(spec: StructuredSpec, param: str) -> StructuredSpec:
    try:
        check_spec(spec)
    except InvalidRequest as e:
        raise _bad(str(e), param, "invalid_schema" if spec.kind == "json" else "invalid_value") \
            from None
    return spec


def _schema_spec(schema: Any, param: str) -> StructuredSpec:
    try:
        return _checked(spec_for_json_schema(schema), param)
    except InvalidRequest as e:
        raise _bad(str(e), param, "invalid_schema") from None


def _response_format(fmt: Any) -> StructuredSpec | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise _bad("'response_format' must be an object", param, "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("'response_format.json_schema' must be an object with 'name' and "
                       "'schema'", f"{param}.json_schema")
        name = js.get("name")
        if name is not None and not (isinstance(name, str) and _NAME.match(name)):
            raise _bad("'response_format.json_schema.name' must be 1-64 letters, digits, _ "
                       "or -", f"{param}.json_schema.name")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad("'response_format.json_schema.strict' must be a boolean",
                       f"{param}.json_schema.strict", "invalid_type")
        if "schema" not in js or js["schema"] is None:
            raise _bad("'response_format.json_schema.schema' is required",
                       f"{param}.json_schema.schema", "missing_required")
        return _schema_spec(js["schema"], f"{param}.json_schema.schema")
    raise _bad(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
               f"{kind!r}", f"{param}.type", "unsupported")


def _one(key: str, value: Any, param: str) -> StructuredSpec:
    if key == "json":
        return _schema_spec(value, param)
    if key == "json_object":
        if value is not True:
            raise _bad(f"'{param}' must be true", param)
        return StructuredSpec("json_object")
    if key in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(f"'{param}' must be a non-empty string", param, "invalid_type")
        return _checked(StructuredSpec(key, value), param)
    if not (isinstance(value, list) and value
            and all(isinstance(c, str) and c for c in value)):
        raise _bad(f"'{param}' must be a non-empty list of non-empty strings", param,
                   "invalid_type")
    return _checked(spec_for_choice(value), param)


def parse_constraint(body: dict) -> tuple[StructuredSpec | None, str | None]:
    """The output constraint of a /v1/completions or /v1/chat/completions body (tools
    aside) and the field it came from.

    Raises: ApiError 400 naming the field: a malformed field, an invalid or unsupported
        schema / regex / grammar, or more than one constraint.
    """
    found: list[tuple[StructuredSpec, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'structured_outputs' must be an object", "structured_outputs",
                       "invalid_type")
        unknown = sorted(set(so) - set(_SO_KEYS) - set(_SO_IGNORED))
        if unknown:
            raise _bad(f"'structured_outputs.{unknown[0]}' is not supported (supported: "
                       f"{', '.join(_SO_KEYS)})", f"structured_outputs.{unknown[0]}",
                       "unsupported")
        for key in _SO_KEYS:
            if so.get(key) is not None:
                found.append((_one(key, so[key], f"structured_outputs.{key}"),
                              f"structured_outputs.{key}"))
    for legacy, key in _LEGACY.items():
        if body.get(legacy) is not None:
            found.append((_one(key, body[legacy], legacy), legacy))
    if len(found) > 1:
        raise _bad(f"only one output constraint per request; got {len(found)} ("
                   f"{', '.join(p for _, p in found)})", found[1][1], "conflicting_constraints")
    return (found[0][0], found[0][1]) if found else (None, None)


def _tool(t: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise _bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                   where, "unsupported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"'{where}.function' must be an object", f"{where}.function", "invalid_type")
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.match(name)):
        raise _bad(f"'{where}.function.name' must be 1-64 letters, digits, _ or -",
                   f"{where}.function.name")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    _schema_spec(params, f"{where}.function.parameters")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def parse_tools(body: dict, accepts_tools: bool) -> tuple[ToolPlan | None, StructuredSpec | None]:
    """`tools` and `tool_choice` of a chat body -> (ToolPlan or None, its constraint).

    accepts_tools: the chat template renders tools (has a tool format), else "auto" is a 400.
    Raises: ApiError 400 for malformed tools, an unknown named function, a tool_choice
        without tools, or "auto" on a template without a tool format.
    """
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _bad("'functions' / 'function_call' are deprecated and not supported; use "
                   "'tools' and 'tool_choice'", "functions", "unsupported")
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None, None
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list of tools", "tools", "invalid_type")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none", tools=tools), None
    if choice == "auto":
        if not accepts_tools:
            raise _bad("tool_choice 'auto' needs a chat template with a tool-call format; this "
                       "model's template has none. Use tool_choice 'required' or a named "
                       "function", "tool_choice", "unsupported")
        return ToolPlan("auto", tools=tools), None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n},
                                                   "parameters": f["parameters"]},
                  "required": ["name", "parameters"]} for n, f in by_name.items()]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan("required", tools=tools), _schema_spec(schema, "tools")
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise _bad(f"tool_choice names function {name!r}, which is not in 'tools'",
                       "tool_choice.function.name")
        return (ToolPlan("named", name=name, tools=tools),
                _schema_spec(by_name[name]["parameters"], "tool_choice"))
    raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
               "\"function\": {\"name\": ...}}", "tool_choice", "invalid_value")


def new_call_id() -> str:
    """A tool call id ("call_" + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[list[tuple[str, str]], str] | None:
    """Tool calls written in the Hermes format most tool-capable chat templates use
    (Qwen2.5, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call. Returns ([(name, arguments JSON)], the text outside the blocks), or
    None when the text has no well-formed call."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append((obj["name"], args if isinstance(args, str)
                      else json.dumps(args, ensure_ascii=False)))
    return (calls, _HERMES.sub("", text).strip()) if calls else None


def tool_calls(plan: ToolPlan, text: str) -> list[dict] | None:
    """The OpenAI `tool_calls` of a finished output, or None when the text is not a
    complete call (cut by max_tokens, or "auto" and the model answered in text: the caller
    returns it as content)."""
    if plan.mode == "auto":
        parsed = parse_hermes(text)
        if parsed is None:
            return None
        calls = parsed[0]
    elif plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        calls = [(plan.name, text)]
    else:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": name, "arguments": args}} for name, args in calls]


def chat_message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat `message` and finish_reason of a finished choice under a constraining plan:
    tool_calls with finish_reason "tool_calls" when the output is a complete call, else the
    text as content with the engine's finish_reason (e.g. "length")."""
    calls = tool_calls(plan, text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    content = None
    if plan.mode == "auto":
        content = parse_hermes(text)[1] or None      # text around the calls, if any
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


class ToolStream:
    """A streamed choice's tool call, in the chunks OpenAI streams.

    Named function: the first delta carries {index, id, type, function: {name, arguments:
    ""}}, then each text delta is a {"function": {"arguments": ...}} fragment. "required"
    and "auto": the calls are known only once the output is complete, so they arrive whole
    in the last delta (with "auto", text that holds no call arrives there as content). The last chunk's finish_reason is "tool_calls" when the output is a
    complete call.
    """

    def __init__(self, plan: ToolPlan):
        self.plan, self.text = plan, []
        self.call_id = new_call_id()

    def opening(self) -> dict:
        """The first delta (role chunk)."""
        delta: dict = {"role": "assistant", "content": None}
        if self.plan.mode == "named":
            delta["tool_calls"] = [{"index": 0, "id": self.call_id, "type": "function",
                                    "function": {"name": self.plan.name, "arguments": ""}}]
        return delta

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(delta, finish_reason) for one engine delta; finish_reason None while running."""
        self.text.append(new_text)
        done = finish_reason is not None
        if self.plan.mode == "named":
            delta = ({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}
                     if new_text else {})
            if done and finish_reason == "stop":
                finish_reason = "tool_calls"
            return delta, finish_reason
        if not done:
            return {}, None
        text = "".join(self.text)
        calls = tool_calls(self.plan, text) if finish_reason == "stop" else None
        if calls is None:
            return ({"content": text} if text else {}), finish_reason
        delta: dict = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if self.plan.mode == "auto" and parse_hermes(text)[1]:
            delta["content"] = parse_hermes(text)[1]
        return delta, "tool_calls"
