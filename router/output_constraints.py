"""What a request says its output must match (structured outputs) or lean towards (logit_bias).

A request can give the structure of its output in any of the ways clients send it, and each
becomes the one `StructuredSpec` the engine enforces (workers/structured/spec.py):

    response_format      OpenAI's {"type": "json_object"} or {"type": "json_schema",
                         "json_schema": {"name", "description"?, "schema", "strict"?}};
                         {"type": "text"} asks for nothing
    structured_outputs   vLLM's object: one of json (a schema, or its text), regex, choice,
                         grammar, json_object
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

A request gives one source at most: with two, which one it means is not for the server to
guess (vLLM lets response_format override structured_outputs silently), so it is a 400 that
names both. Whether a spec compiles is the ingress's check (router/grammar_check.py), which
needs the tokenizer; here only its shape is checked.

`logit_bias` is OpenAI's: token ids (as strings) to a bias in [-100, 100], at most 300; that
the ids are in the vocabulary is EngineClient's check, which knows the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tandem.workers.core.request import MAX_LOGIT_BIAS
from tandem.workers.structured.spec import StructuredSpec

# Unknown keys inside these objects are refused, not ignored: a misspelt constraint ignored
# would be an unconstrained answer.
_NESTED = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
GUIDED_BACKENDS = ("xgrammar", "auto")  # what tandem compiles with, and "the server's choice"
TOKEN_ID_KEY = r"^[0-9]{1,10}$"

JsonSchema = dict[str, Any]
# Its size is checked by `_one_spec`, in words of ours (pydantic's own message changes between
# versions); the document still states the bound.
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Annotated[float, Field(ge=-100, le=100)]],
                      Field(json_schema_extra={"maxProperties": MAX_LOGIT_BIAS})]


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = _NESTED
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None  # the schema is always enforced: strict or not, the output matches it


class ResponseFormat(BaseModel):
    model_config = _NESTED
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams), as far as tandem does it."""

    model_config = _NESTED
    json_: JsonSchema | str | None = Field(None, alias="json")  # `json` would shadow BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Accepted as what tandem does anyway: its JSON has no free whitespace and no properties a
    # schema does not name (xgrammar's strict mode), and it has no other backend to fall back to.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    # Refused by name (see _check_structured_outputs).
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@dataclass(frozen=True)
class SpecSource:
    """A request's StructuredSpec and the field it came from (errors about it name that field)."""

    field: str
    spec: StructuredSpec


class OutputConstraints(BaseModel):
    """The request fields above, mixed into both APIs' request models (protocol.py)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # protocol.py's _Strict
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None  # refused by name
    logit_bias: LogitBias | None = None

    _structured: SpecSource | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_spec(self) -> OutputConstraints:
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GUIDED_BACKENDS:
            raise ValueError(f"guided_decoding_backend: tandem compiles structured outputs with xgrammar; send "
                             f"'xgrammar' or 'auto' (or nothing), got {self.guided_decoding_backend!r}")
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern: not supported: tandem's JSON output has no free "
                             "whitespace to shape")
        sources = [source for source in (_from_response_format(self.response_format),
                                         _from_structured_outputs(self.structured_outputs),
                                         _guided("guided_json", self.guided_json),
                                         _guided("guided_regex", self.guided_regex),
                                         _guided("guided_choice", self.guided_choice),
                                         _guided("guided_grammar", self.guided_grammar)) if source is not None]
        if len(sources) > 1:
            names = [s.field for s in sources]
            raise ValueError(f"{names[0]}: give the output's structure one way, not {' and '.join(names)}")
        self._structured = sources[0] if sources else None
        return self

    @property
    def structured_source(self) -> SpecSource | None:
        """The request's spec and where it came from; None when it asks for no structure."""
        return self._structured

    def constraint_kwargs(self) -> dict[str, Any]:
        """The `SamplingParams` keyword arguments these fields set (none when unset)."""
        kwargs: dict[str, Any] = {}
        if self._structured is not None:
            kwargs["structured"] = self._structured.spec
        if self.logit_bias:
            kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return kwargs


def _from_response_format(fmt: ResponseFormat | None) -> SpecSource | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise ValueError("response_format: json_schema goes with type 'json_schema', not 'text'")
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise ValueError("response_format: json_schema goes with type 'json_schema', not 'json_object'")
        return SpecSource("response_format", StructuredSpec("json_object"))
    if fmt.json_schema is None:
        raise ValueError("response_format: type 'json_schema' needs a json_schema object "
                         "({\"name\": ..., \"schema\": {...}})")
    if fmt.json_schema.schema_ is None:
        raise ValueError("response_format: json_schema.schema is missing: tandem enforces the schema it is given, "
                         "and without one there is nothing to enforce (use type 'json_object' for any JSON object)")
    return _spec("response_format", lambda: StructuredSpec.json_schema(fmt.json_schema.schema_))


def _from_structured_outputs(outputs: StructuredOutputs | None) -> SpecSource | None:
    if outputs is None:
        return None
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(outputs, name) is not None:
            raise ValueError(f"structured_outputs: {name} is not supported by tandem (it takes json, regex, "
                             "choice, grammar or json_object)")
    kinds = {"json": outputs.json_, "regex": outputs.regex, "choice": outputs.choice, "grammar": outputs.grammar,
             "json_object": outputs.json_object or None}  # json_object: false asks for nothing
    given = [kind for kind, value in kinds.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"structured_outputs: give one of json, regex, choice, grammar and json_object, "
                         f"not {' and '.join(given)}")
    if not given:
        return None
    kind = given[0]
    return _guided("structured_outputs", kinds[kind], "json_schema" if kind == "json" else kind)


def _guided(field: str, value: Any, kind: str | None = None) -> SpecSource | None:
    """The spec of a guided_* field (its kind from its name) or of one structured_outputs key."""
    if value is None:
        return None
    kind = kind or field.removeprefix("guided_")
    if kind == "json":
        kind = "json_schema"
    if kind == "json_schema":
        return _spec(field, lambda: StructuredSpec.json_schema(value))
    if kind == "choice":
        return _spec(field, lambda: StructuredSpec.choice(value))
    if kind == "json_object":
        return _spec(field, lambda: StructuredSpec("json_object"))
    return _spec(field, lambda: StructuredSpec(kind, value))


def _spec(field: str, build: Any) -> SpecSource:
    """A spec built by `build`, its errors said as the field's ("guided_regex: the regex is empty")."""
    try:
        return SpecSource(field, build())
    except (ValueError, TypeError) as exc:
        reason = str(exc).removeprefix("structured output: ")
        raise ValueError(f"{field}: {reason}") from None
