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
