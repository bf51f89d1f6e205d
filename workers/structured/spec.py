"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of
choices, or an EBNF grammar. Plain data (it travels inside SamplingParams to the group); the
grammar engine compiles it there (workers/structured/grammar_cache.py).

The API layer builds one from OpenAI's `response_format`, vLLM's `structured_outputs` (and its
older `guided_*` fields), a forced tool call, or gRPC's `SamplingParams`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# json: a JSON schema (its text); json_object: any JSON object; regex: a regular expression the
# whole output matches; choice: one of the strings (the text is their JSON array); grammar: EBNF
# (GBNF-style rules, `root ::= ...`).
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema or grammar bigger than this is refused (compile time and memory)


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: str = ""  # the schema / regex / grammar text, or the choices as a JSON array

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output: {self.kind} must be given as text, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output: the {self.kind} is {len(self.value)} characters; "
                             f"at most {MAX_SPEC_CHARS} are accepted")
        if self.kind == "json_object":
            if self.value:
                raise ValueError("structured output: json_object takes no schema")
        elif not self.value:
            raise ValueError(f"structured output: the {self.kind} is empty")
        if self.kind == "choice":
            choices = json.loads(self.value)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("structured output: choice must be a non-empty list of non-empty strings")

    @staticmethod
    def json_schema(schema: dict[str, Any] | str) -> StructuredSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return StructuredSpec("json", text)

    @staticmethod
    def choice(choices: list[str]) -> StructuredSpec:
        return StructuredSpec("choice", json.dumps(list(choices)))

    def choices(self) -> list[str]:
        return json.loads(self.value)
