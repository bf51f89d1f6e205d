"""The JSON schema a forced tool call is decoded under (`tool_choice` "required" or a named
function), so that what the model writes always parses as the call the client asked for.

The shapes are vLLM's, so a client moving between the two servers sees the same output:

- a named function: the output is its arguments, an object of its `parameters` schema. The
  name is the request's, so the model spends no tokens on it, and the arguments stream as they
  come with nothing to parse around them (tool_parsers/forced.py);
- "required": an array of one or more calls (exactly one when `parallel_tool_calls` is false),
  each `{"name": <one of the tools>, "parameters": <that tool's schema>}`: an `anyOf` with one
  branch per tool, so a call's parameters are those of the tool it names.

A function without `parameters` takes an empty object. In the "required" array each tool's
schema sits under `items`, so its local references are moved there and its `$defs` (or
`definitions`) go to the top, renamed per tool so that two tools' definitions never collide.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.workers.structured.spec import MAX_SPEC_CHARS, StructuredSpec

EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema, and a named function's whole output: its `parameters`, an
    object (the type said where they leave it out)."""
    if not parameters:
        return dict(EMPTY_OBJECT)
    return parameters if "type" in parameters else {"type": "object", **parameters}


def required_calls_schema(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The array of calls for `tool_choice: "required"`; `functions` as (name, parameters)."""
    branches, defs = [], {}
    for i, (name, parameters) in enumerate(functions):
        at = f"/items/anyOf/{i}/properties/parameters"
        schema = _relocate(parameters_schema(parameters), at, f"{i}_")
        for key in ("$defs", "definitions"):
            for def_name, definition in (schema.pop(key, None) or {}).items():
                defs[f"{i}_{def_name}"] = definition
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                         "required": ["name", "parameters"], "additionalProperties": False})
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


def forced_call_spec(schema: dict[str, Any]) -> StructuredSpec:
    """The engine's constraint for `schema`; ValueError naming `tools` when it is too large."""
    # Written as given, not key-sorted: the engine writes properties in the schema's order,
    # and a model writes best in the order its tool states.
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"tools: the forced tool call's schema is {len(text)} characters (from the tools' "
                         f"parameters); at most {MAX_SPEC_CHARS} are accepted")
    return StructuredSpec.json_schema(text)


def _relocate(schema: Any, at: str, prefix: str) -> Any:
    """`schema` for the place `at` (a JSON pointer) of a larger schema: its local references
    point there, and those into its definitions name them with `prefix` (they move to the top)."""
    if isinstance(schema, list):
        return [_relocate(item, at, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _moved_ref(value, at, prefix)
        else:
            out[key] = _relocate(value, at, prefix)
    return out


def _moved_ref(ref: str, at: str, prefix: str) -> str:
    for defs in ("#/$defs/", "#/definitions/"):
        if ref.startswith(defs):
            return "#/$defs/" + prefix + ref[len(defs):]
    return "#" + at + ref[1:]
