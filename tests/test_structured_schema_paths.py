"""Where a refused JSON schema construct sits reads as a place: "the schema root" or a
JSON pointer (RFC 6901), never a bare "#"."""

from __future__ import annotations

import json

import pytest

from mooncaked.engine.structured import _check_schema, schema_location, unsupported
from mooncaked.engine.types import InvalidRequest


def test_root_and_nested_locations():
    assert unsupported({"not": {"const": 1}}) == "'not' at the schema root is not supported"
    nested = {"type": "object", "properties": {"a/b~c": {"anyOf": [
        {"type": "string"}, {"type": "string", "format": "color"}]}}}
    why = unsupported(nested)
    assert why.startswith("format 'color' at #/properties/a~1b~0c/anyOf/1 is not supported")
    assert schema_location(()) == "the schema root"
    assert schema_location(("$defs", "x", "items", 0)) == "#/$defs/x/items/0"


@pytest.mark.parametrize("schema, where", [
    ({"uniqueItems": True, "type": "array"}, "'uniqueItems' at the schema root"),
    ({"type": 5}, "invalid JSON schema at #/type"),
])
def test_check_schema_errors_name_the_place(schema, where):
    with pytest.raises(InvalidRequest) as e:
        _check_schema(json.dumps(schema))
    assert where in str(e.value) and " at #:" not in str(e.value) and " at # " not in str(e.value)


@pytest.mark.parametrize("schema, why", [
    # xgrammar 0.2.9 drops the lengths beside a pattern ({"k": "aaaaaaaa..."} came out)
    ({"type": "object", "properties": {"k": {"type": "string", "pattern": "^a+$",
                                             "maxLength": 2}}},
     "'maxLength' beside 'pattern' at #/properties/k"),
    # ... and drops a pattern its regex converter refuses ({"w": "xylophone"} came out)
    ({"type": "object", "properties": {"w": {"type": "string", "pattern": "^(?!x)[a-z]+$"}}},
     "'pattern' '^(?!x)[a-z]+$' at #/properties/w"),
    ({"type": "array", "items": {"type": "string", "pattern": "(a)\\1"}}, "at #/items"),
    ({"type": "object", "patternProperties": {"(?<=a)b": {"type": "integer"}}},
     "'patternProperties' key '(?<=a)b' at the schema root"),
])
def test_a_pattern_the_grammar_would_drop_is_refused_with_its_place(schema, why):
    """Issue 32, fault 2: a schema either holds or is a 400 naming keyword and path."""
    with pytest.raises(InvalidRequest) as e:
        _check_schema(json.dumps(schema))
    assert why in str(e.value) and e.value.param == "structured_outputs", str(e.value)


def test_a_pattern_the_grammar_enforces_is_kept_and_holds():
    """Checked offline with xgrammar's own matcher: a supported pattern is enforced."""
    import xgrammar as xgr

    from mooncaked.engine.structured import grammar, spec_for_json_schema

    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^a+$"}},
              "required": ["k"]}
    g = grammar(spec_for_json_schema(schema))
    accepts = xgr.testing._is_grammar_accept_string
    assert accepts(g, '{"k": "aa"}') and not accepts(g, '{"k": "ab"}')


def test_length_bounded_strings_are_json_strings_with_escapes():
    """Issue 32, fault 3 (xgrammar #800): a string with minLength/maxLength and no pattern
    took raw control characters (a tab: invalid JSON) and no escapes. Checked offline with
    xgrammar's own matcher: escapes are allowed and count as one character, raw control
    characters are not, and the bounds hold, nested in arrays too."""
    import xgrammar as xgr

    from mooncaked.engine.structured import grammar, spec_for_json_schema

    schema = {"type": "object", "properties": {
        "k": {"type": "string", "minLength": 1, "maxLength": 3},
        "n": {"type": "array", "items": {"type": "string", "maxLength": 2}}},
        "required": ["k", "n"]}
    g = grammar(spec_for_json_schema(schema))
    accepts = xgr.testing._is_grammar_accept_string
    for text in ('{"k": "abc", "n": []}', '{"k": "a\\tb", "n": ["\\n"]}',
                 '{"k": "\\u00e9\\"x", "n": ["a\\\\", "\\/"]}', '{"k": "é€😀", "n": [""]}'):
        assert accepts(g, text), text
        assert json.loads(text)        # and they are JSON
    for text in ('{"k": "a\tb", "n": []}', '{"k": "x", "n": ["\n"]}', '{"k": "\x01", "n": []}',
                 '{"k": "abcd", "n": []}', '{"k": "", "n": []}', '{"k": "x", "n": ["abc"]}',
                 '{"k": "\\x", "n": []}'):
        assert not accepts(g, text), text
