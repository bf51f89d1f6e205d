"""The schemas forced tool calls are decoded under, checked with jsonschema: what they accept is
exactly a call the client asked for."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.router.tool_schema import forced_call_spec, parameters_schema, required_calls_schema
from tandem.workers.structured.spec import MAX_SPEC_CHARS, StructuredSpec

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
# References into its own definitions and to its root: both must still resolve once nested.
TREE = {"type": "object", "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer", "minimum": 0, "maximum": 9},
            "child": {"$ref": "#/$defs/node"}}, "required": ["value"], "additionalProperties": False}},
        "properties": {"root": {"$ref": "#/$defs/node"}, "copy": {"$ref": "#/properties/root"}},
        "required": ["root"], "additionalProperties": False}
# Another tool's definition of the same name: the two must not collide.
OTHER = {"type": "object", "definitions": {"node": {"type": "string", "maxLength": 2}},
         "properties": {"tag": {"$ref": "#/definitions/node"}}, "required": ["tag"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("tree", TREE), ("other", OTHER), ("noop", None)]


def _valid(schema: dict, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_a_named_function_is_held_to_its_parameters():
    assert parameters_schema(WEATHER) is WEATHER
    assert _valid(parameters_schema(WEATHER), {"city": "Paris", "unit": "c"})
    assert not _valid(parameters_schema(WEATHER), {"city": "Paris", "unit": "k"})
    assert not _valid(parameters_schema(WEATHER), {"unit": "c"})
    assert not _valid(parameters_schema(WEATHER), ["Paris"])
    # No parameters: an empty object; parameters that leave the type out: an object still.
    assert parameters_schema(None) == {"type": "object", "properties": {}}
    assert parameters_schema({}) == {"type": "object", "properties": {}}
    assert parameters_schema({"properties": {"a": {"type": "integer"}}}) == {
        "type": "object", "properties": {"a": {"type": "integer"}}}


def test_required_accepts_one_or_more_calls_each_with_its_own_tools_parameters():
    schema = required_calls_schema(TOOLS, parallel=True)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    tree = {"name": "tree", "parameters": {"root": {"value": 1, "child": {"value": 2}}, "copy": {"value": 3}}}
    other = {"name": "other", "parameters": {"tag": "ab"}}
    noop = {"name": "noop", "parameters": {}}
    assert _valid(schema, [weather])
    assert _valid(schema, [weather, tree, other, noop])
    assert not _valid(schema, [])
    assert not _valid(schema, [{"name": "get_weather", "parameters": {"root": {"value": 1}}}])  # another's parameters
    assert not _valid(schema, [{"name": "nope", "parameters": {}}])
    assert not _valid(schema, [{**weather, "id": 1}])
    assert not _valid(schema, [{"name": "get_weather"}])
    assert not _valid(schema, [{"name": "tree", "parameters": {"root": {"value": 1, "child": {"value": 10}}}}])
    assert not _valid(schema, [{"name": "tree", "parameters": {"root": {"value": 1}, "copy": {}}}])
    assert not _valid(schema, [{"name": "other", "parameters": {"tag": "abc"}}])
    assert sorted(schema["$defs"]) == ["1_node", "2_node"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["copy"] == {
        "$ref": "#/items/anyOf/1/properties/parameters/properties/root"}


def test_required_without_parallel_calls_takes_exactly_one():
    schema = required_calls_schema(TOOLS, parallel=False)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert _valid(schema, [weather])
    assert not _valid(schema, [weather, weather])
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)


def test_the_spec_keeps_the_tools_key_order_and_is_bounded():
    spec = forced_call_spec(WEATHER)
    assert spec == StructuredSpec("json", json.dumps(WEATHER, separators=(",", ":")))
    assert spec.value.index('"city"') < spec.value.index('"unit"') < spec.value.index('"required"')
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
    size = len(json.dumps(big, separators=(",", ":")))
    with pytest.raises(ValueError, match=rf"^tools: the forced tool call's schema is {size} characters \(from the "
                                         rf"tools' parameters\); at most {MAX_SPEC_CHARS} are accepted$"):
        forced_call_spec(big)
