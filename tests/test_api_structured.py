"""Structured outputs and tool calls through the OpenAI API of one `serve --role all`.

JSON schemas (tests/structured_schemas.py), greedy and seeded-sampled, all in flight at once
(one batched decode); every output parses and validates with `jsonschema`. Regex and choice
outputs match; tool calls parse, streamed and not; bad constraints get 400s naming the
problem. Greedy P/D equality is in tests/test_kv_paths_e2e.py (its cluster).
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import pytest
from cluster_harness import apost as post, stream
from structured_schemas import SCHEMAS

from mooncaked.engine import structured
from mooncaked.engine.types import StructuredSpec

MAX_TOKENS = 80           # every schema's longest valid output is far shorter
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_server):
    """The run's default server (conftest): shared, so tests leave it as they found it."""
    return default_server


def _chat(server, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(post(s, f"{server.url}/v1/chat/completions", b)
                                          for b in bodies))
    return asyncio.run(go())


def _schema_body(question: str, schema: dict, seed: int | None) -> dict:
    body = {"messages": [{"role": "user", "content": f"{question} Answer in JSON."}],
            "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "out", "schema": schema, "strict": True}}}
    # sampled: a usual setting (top-k 40); at temperature 1 with no filter a 135M model
    # spends a string's characters on multi-token emoji
    body.update({"temperature": 0} if seed is None else {"temperature": 0.8, "top_k": 40,
                                                         "seed": seed})
    return body


def test_json_schemas_greedy_and_seeded_outputs_validate(server):
    assert len(SCHEMAS) >= 20
    cases = [(name, schema, seed) for name, _, schema in SCHEMAS for seed in (None, 1234)]
    bodies = [_schema_body(q, schema, seed) for _, q, schema in SCHEMAS for seed in (None, 1234)]
    for (name, schema, seed), (status, body) in zip(cases, _chat(server, bodies)):
        assert status == 200, (name, body)
        choice = body["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (name, seed, text)
        jsonschema.validate(json.loads(text), schema)   # raises naming the schema's rule


def test_regex_choice_json_object_and_legacy_fields_on_both_endpoints(server):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "it depends"]

    async def go():
        async with aiohttp.ClientSession() as s:
            comp = f"{server.url}/v1/completions"
            chat = f"{server.url}/v1/chat/completions"
            base = {"prompt": "My answer:", "max_tokens": 20, "temperature": 0}
            msgs = {"messages": ASK, "max_tokens": 40, "temperature": 0}
            return await asyncio.gather(
                post(s, comp, {**base, "structured_outputs": {"regex": regex}}),
                post(s, comp, {**base, "guided_regex": regex, "seed": 5, "temperature": 1.0}),
                post(s, comp, {**base, "structured_outputs": {"choice": choices}}),
                post(s, chat, {**msgs, "guided_choice": choices, "temperature": 1.0, "seed": 9}),
                post(s, chat, {**msgs, "response_format": {"type": "json_object"}}),
                post(s, comp, {**base, "max_tokens": 40,
                               "response_format": {"type": "json_object"}}),
                post(s, comp, {**base, "guided_json": {"type": "array", "maxItems": 2,
                                                       "items": {"type": "integer"}}}))
    r = asyncio.run(go())
    assert all(status == 200 for status, _ in r), r
    texts = [b["choices"][0].get("text", b["choices"][0].get("message", {}).get("content"))
             for _, b in r]
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1]), texts[:2]
    assert texts[2] in choices and texts[3] in choices, texts[2:4]
    assert isinstance(json.loads(texts[4]), dict) and isinstance(json.loads(texts[5]), dict)
    arr = json.loads(texts[6])
    assert isinstance(arr, list) and len(arr) <= 2


def test_max_tokens_cut_is_length_and_n_choices_each_valid(server):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}},
              "required": ["story"]}
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}}, "required": ["n"]}
    cut, many = _chat(server, [{**_schema_body("Tell a story.", schema, None), "max_tokens": 6},
                               {**_schema_body("Pick a digit.", small, 77), "n": 3}])
    assert cut[0] == 200 and many[0] == 200
    c = cut[1]["choices"][0]
    assert c["finish_reason"] == "length"
    assert c["message"]["content"].startswith('{"story": "')
    assert cut[1]["usage"]["completion_tokens"] == 6
    assert len(many[1]["choices"]) == 3
    for ch in many[1]["choices"]:
        assert ch["finish_reason"] == "stop"
        jsonschema.validate(json.loads(ch["message"]["content"]), small)


def _tool_body(choice, **kw) -> dict:
    return {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX_TOKENS,
            "temperature": 0, **kw}


def _check_calls(calls: list[dict]) -> None:
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])


def test_tool_calls_named_required_and_none_not_streamed(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r_named, r_req, r_none = _chat(server, [_tool_body(named), _tool_body("required"),
                                            _tool_body("none", max_tokens=8)])
    for status, body in (r_named, r_req, r_none):
        assert status == 200, body
    c = r_named[1]["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_weather"]
    _check_calls(c["message"]["tool_calls"])
    c = r_req[1]["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    _check_calls(c["message"]["tool_calls"])
    c = r_none[1]["choices"][0]
    assert "tool_calls" not in c["message"] and isinstance(c["message"]["content"], str)
    assert c["finish_reason"] in ("stop", "length")


def test_tool_calls_streamed_as_openai_streams_them_equal_the_non_streamed(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = _chat(server, [_tool_body(named), _tool_body("required")])

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{server.url}/v1/chat/completions"
            return await asyncio.gather(stream(s, url, _tool_body(named, stream=True)),
                                        stream(s, url, _tool_body("required", stream=True)))
    for (_, ref), events in zip(plain, asyncio.run(go())):
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        assert chunks[0]["delta"]["role"] == "assistant"
        calls: dict[int, dict] = {}
        for ch in chunks:
            for tc in ch["delta"].get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                if "id" in tc:
                    call["id"] = tc["id"]
                call["name"] += tc.get("function", {}).get("name", "")
                call["arguments"] += tc.get("function", {}).get("arguments", "")
            assert "content" not in ch["delta"] or ch["delta"]["content"] is None
        assert chunks[-1]["finish_reason"] == "tool_calls"
        assert all(ch["finish_reason"] is None for ch in chunks[:-1])
        want = [(t["function"]["name"], t["function"]["arguments"])
                for t in ref["choices"][0]["message"]["tool_calls"]]
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
        assert all(calls[i]["id"].startswith("call_") for i in calls)


def _err(status_body, status, param, *words):
    status_, body = status_body
    assert status_ == status, body
    err = body["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
UNSUPPORTED = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}}}
# (id, body for /v1/chat/completions, param, words the message must name)
BAD = [
    ("invalid_schema", {"response_format": BAD_SCHEMA}, "response_format.json_schema.schema",
     ["#/type"]),
    ("unsupported_construct", {"response_format": UNSUPPORTED},
     "response_format.json_schema.schema", ["'not'", "#/properties/a"]),
    ("empty_range", {"structured_outputs": {"json": {"type": "integer", "minimum": 5,
                                                     "maximum": 1}}},
     "structured_outputs.json", ["minimum"]),
    ("schema_not_json", {"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ("missing_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", ["required"]),
    ("unknown_format_type", {"response_format": {"type": "yaml"}}, "response_format.type",
     ["yaml"]),
    ("bad_regex", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
     ["parenthesis"]),
    ("bad_grammar", {"structured_outputs": {"grammar": "root ::= nope"}},
     "structured_outputs.grammar", ["nope"]),
    ("empty_choice", {"guided_choice": []}, "guided_choice", ["non-empty"]),
    ("unknown_structured_key", {"structured_outputs": {"structural_tag": "x"}},
     "structured_outputs.structural_tag", ["structural_tag"]),
    ("two_constraints", {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]},
     "guided_choice", ["only one"]),
    ("auto_without_tool_format", {"tools": TOOLS}, "tool_choice", ["auto", "template"]),
    ("unknown_named_tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "tool_choice.function.name", ["nope"]),
    ("tool_choice_without_tools", {"tool_choice": "required"}, "tool_choice", ["tools"]),
    ("bad_tool_parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
        "tool_choice": "required"}, "tools[0].function.parameters", ["#/properties/x/type"]),
    ("tools_with_response_format", {"tools": TOOLS, "tool_choice": "required",
                                    "response_format": {"type": "json_object"}},
     "tool_choice", ["response_format"]),
]


def test_bad_constraints_get_400_naming_the_problem(server):
    bodies = [{"messages": ASK, "max_tokens": 4, **b} for _, b, _, _ in BAD]
    for (name, _, param, words), got in zip(BAD, _chat(server, bodies)):
        try:
            _err(got, 400, param, *words)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    # the server still serves
    (status, body), = _chat(server, [_tool_body("required")])
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"


def test_grammars_are_built_once_per_spec():
    spec = structured.spec_for_json_schema('{"type": "object", "properties": {"q": {}}}')
    before = structured.grammar.cache_info()
    for _ in range(3):
        structured.check_spec(structured.spec_for_json_schema({"type": "object",
                                                                "properties": {"q": {}}}))
    after = structured.grammar.cache_info()
    assert spec == StructuredSpec("json", '{"type":"object","properties":{"q":{}}}')
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 2


def test_auto_tool_calls_parse_the_hermes_format_and_stream_whole():
    from mooncaked.api.structured import ToolPlan, ToolStream, chat_message

    plan = ToolPlan("auto", tools=TOOLS)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
            '{"tz": "CET"}}</tool_call>')
    msg, reason = chat_message(plan, text, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                            ("get_time", {"tz": "CET"})]
    assert chat_message(plan, "Sunny, 20 C.", "stop") == (
        {"role": "assistant", "content": "Sunny, 20 C."}, "stop")
    assert chat_message(plan, "<tool_call>{bad</tool_call>", "stop")[1] == "stop"
    st = ToolStream(plan)
    assert st.delta(text[:30], None) == ({}, None)
    delta, reason = st.delta(text[30:], "stop")
    assert reason == "tool_calls" and [c["index"] for c in delta["tool_calls"]] == [0, 1]
    assert delta["content"] == "Let me check."


def test_length_bounded_strings_parse_strictly_and_validate(server):
    """Issue 32, fault 3: tab-separated rows into a string with maxLength gave a raw tab
    (`{"row": "3\\tbob\\t33"}`, which a strict parser refuses). Now every answer, greedy
    and sampled, parses with orjson and validates with jsonschema."""
    import orjson

    schema = {"type": "object", "properties": {"row": {"type": "string", "maxLength": 60}},
              "required": ["row"]}
    rows = "id\tname\tage\n1\tann\t31\n2\tbo\t25\n3\tbob\t33\n"
    fmt = {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}
    bodies = [{"prompt": f"{rows}Copy the last row, tabs included, as JSON:", "max_tokens": 40,
               "response_format": fmt, "temperature": t, "seed": seed}
              for t, seed in ((0, None), (1.0, 1), (1.0, 2), (1.0, 3))]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(post(s, f"{server.url}/v1/completions", b)
                                          for b in bodies))
    for status, body in asyncio.run(go()):
        assert status == 200, body
        text = body["choices"][0]["text"]
        if body["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(orjson.loads(text), schema)
        else:                                     # cut by max_tokens: no control character
            assert not any(ord(ch) < 0x20 for ch in text), text
