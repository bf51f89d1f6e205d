"""The API side of structured outputs, logit_bias, refused fields and /tokenize, against the real
ingress over a fake group (tests/serve/fake_group.py): no Ray, so each request takes milliseconds.

What a request asks for is read off the `GroupRequest` the fake group receives; that the engine
then enforces it is tests/model/test_structured_outputs.py's. Compile errors are xgrammar's own,
on the tiny test model's tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from tandem.router import tandem_pb2 as pb
from tandem.router.protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.request_fields import UNSUPPORTED
from tandem.workers.structured.spec import StructuredSpec
from tests.serve.fake_group import MODEL, EchoGroup, FakeGrpcContext, ingress_server, serving

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# The chat tool fields are honoured by the chat model (the tool-calling work), never refused here.
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tandem.workers.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def group() -> EchoGroup:
    return EchoGroup()


@pytest.fixture(scope="module")
def server(tiny_llama, group):
    return ingress_server(tiny_llama, group)


@pytest.fixture(scope="module")
def http(server):
    with serving(server) as client:
        yield client


def post(http, path: str, body: dict):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": "hi"})
    return http.post(path, json={**base, **body})


def error(response, status: int = 400) -> tuple[str | None, str, str | None]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    return body["param"], body["message"], body["code"]


# ---- structured outputs: what reaches the group -----------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredSpec("json", '{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[ab]{2}", "disable_any_whitespace": True}}, StructuredSpec("regex", "[ab]{2}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredSpec.choice(["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"guided_json": SCHEMA}, StructuredSpec.json_schema(SCHEMA)),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, StructuredSpec("regex", "[0-9]+")),
    ({"guided_choice": ["left", "right"], "guided_decoding_backend": "auto"}, StructuredSpec.choice(["left", "right"])),
    ({"guided_grammar": 'root ::= "x"'}, StructuredSpec("grammar", 'root ::= "x"')),
], ids=["text", "json_object", "json_schema", "so-json", "so-json-text", "so-regex", "so-choice", "so-grammar",
        "so-json_object", "so-json_object-false", "guided_json", "guided_regex", "guided_choice", "guided_grammar"])
def test_each_source_of_a_spec_reaches_the_group_as_it(http, group, path, fields, spec) -> None:
    for stream in (False, True):
        response = post(http, path, {**fields, "stream": stream})
        assert response.status_code == 200, response.text
        assert group.calls[-1].sampling.structured == spec


def test_logit_bias_and_decoding_options_reach_the_group(http, group) -> None:
    for path in (COMPLETIONS, CHAT):
        response = post(http, path, {"logit_bias": {"511": 100, "0": -100, "7": 2.5}, "skip_special_tokens": False,
                                     "include_stop_str_in_output": True})
        assert response.status_code == 200, response.text
        sampling = group.calls[-1].sampling
        assert sampling.logit_bias == {511: 100.0, 0: -100.0, 7: 2.5}
        assert (sampling.skip_special_tokens, sampling.include_stop_str_in_output) == (False, True)
    assert post(http, COMPLETIONS, {}).status_code == 200
    assert group.calls[-1].sampling.logit_bias is None and group.calls[-1].sampling.structured is None


@pytest.mark.parametrize("fields, param, message", [
    ({"logit_bias": {"512": 1}}, "logit_bias",
     "logit_bias: token id 512 is not in this model's vocabulary (its ids are below 512)"),
    ({"logit_bias": {"3": 100.5}}, "logit_bias", "logit_bias.3: Input should be less than or equal to 100"),
    ({"logit_bias": {"3": -101}}, "logit_bias", "logit_bias.3: Input should be greater than or equal to -100"),
    ({"logit_bias": {"the": 1}}, "logit_bias", "logit_bias.the.[key]: String should match pattern '^[0-9]{1,10}$'"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias",
     "logit_bias: at most 300 token ids, got 301"),
    ({"logit_bias": {"3": "1"}}, "logit_bias", "logit_bias.3: Input should be a valid number"),
], ids=["past-vocab", "above-100", "below-100", "not-an-id", "301-entries", "string-bias"])
def test_logit_bias_bounds(http, group, fields, param, message) -> None:
    before = len(group.calls)
    for path in (COMPLETIONS, CHAT):
        assert error(post(http, path, fields))[:2] == (param, message)
    assert len(group.calls) == before


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     "response_format: give the output's structure one way, not response_format and guided_regex"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA}, "structured_outputs",
     "structured_outputs: give the output's structure one way, not structured_outputs and guided_json"),
    ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_regex",
     "guided_regex: give the output's structure one way, not guided_regex and guided_grammar"),
    ({"structured_outputs": {"regex": "a", "json": SCHEMA}}, "structured_outputs",
     "structured_outputs: give one of json, regex, choice, grammar and json_object, not json and regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     "response_format: json_schema.schema is missing: tandem enforces the schema it is given, and without one "
     "there is nothing to enforce (use type 'json_object' for any JSON object)"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format: type 'json_schema' needs a json_schema object ({\"name\": ..., \"schema\": {...}})"),
    ({"response_format": {"type": "structural_tag"}}, "response_format",
     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
    ({"structured_outputs": {"whitespace_pattern": r"\s?"}}, "structured_outputs",
     "structured_outputs: whitespace_pattern is not supported by tandem (it takes json, regex, choice, grammar "
     "or json_object)"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structured_outputs: structural_tag is not supported by tandem (it takes json, regex, choice, grammar "
     "or json_object)"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs",
     "structured_outputs.regexp: Extra inputs are not permitted"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "guided_decoding_backend: tandem compiles structured outputs with xgrammar; send 'xgrammar' or 'auto' "
     "(or nothing), got 'outlines'"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "guided_whitespace_pattern: not supported: tandem's JSON output has no free whitespace to shape"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex: the regex is empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice: choice must be a non-empty list of non-empty "
                                                    "strings"),
    ({"guided_grammar": "x" * 70_000}, "guided_grammar",
     "guided_grammar: the grammar is 70000 characters; at most 65536 are accepted"),
], ids=["format-and-guided", "so-and-guided", "two-guided", "two-in-so", "no-schema", "no-json_schema",
        "structural_tag-format", "so-whitespace", "so-structural_tag", "so-misspelt", "backend", "whitespace",
        "empty-regex", "empty-choice", "too-long"])
def test_a_spec_that_says_two_things_or_nothing_usable_is_a_400(http, group, fields, param, message) -> None:
    before = len(group.calls)
    for path in (COMPLETIONS, CHAT):
        assert error(post(http, path, fields))[:2] == (param, message)
    assert len(group.calls) == before


@pytest.mark.parametrize("fields, param, message", [
    ({"guided_regex": "("}, "guided_regex",
     "guided_regex: the regex cannot be compiled: Regex parsing error at position 2: The parenthesis is not closed."),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs",
     "structured_outputs: the regex admits no output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format", 'response_format: the JSON schema cannot be compiled: Unsupported type "nope"'),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "integer", "minimum": 5, "maximum": 3}}}}, "response_format",
     "response_format: the JSON schema cannot be compiled: Invalid range: minimum greater than maximum"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     "structured_outputs: the JSON schema cannot be compiled: not JSON (Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1))"),
    ({"guided_json": "[1, 2]"}, "guided_json", "guided_json: the JSON schema cannot be compiled: a JSON schema is an "
                                               "object"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar",
     'guided_grammar: the grammar cannot be compiled: EBNF parser error at line 1, column 10: Rule "foo" is not '
     "defined"),
], ids=["regex", "regex-admits-nothing", "schema-type", "schema-range", "schema-not-json", "schema-not-object",
        "grammar"])
def test_a_spec_that_cannot_compile_is_a_400_with_xgrammars_reason(http, group, fields, param, message) -> None:
    before = len(group.calls)
    for path in (COMPLETIONS, CHAT):
        for stream in (False, True):  # before any byte of a stream
            assert error(post(http, path, {**fields, "stream": stream})) == (param, message, "invalid_value")
    assert len(group.calls) == before  # no group ever saw it


def test_a_spec_is_compiled_before_admission(tiny_llama) -> None:
    """A full server still says what is wrong with a spec (400), not "come back later" (429)."""
    server = ingress_server(tiny_llama, EchoGroup(), admission={"max_requests_per_group": 1})
    with serving(server) as http:
        server.admission.in_flight = 1  # the one seat taken
        assert error(post(http, COMPLETIONS, {}), 429)[2] == "overloaded"
        assert error(post(http, COMPLETIONS, {"guided_regex": "("}))[:2] == (
            "guided_regex", "guided_regex: the regex cannot be compiled: Regex parsing error at position 2: The "
                            "parenthesis is not closed.")
        context, _ = generate(server, pb.SamplingParams(regex="("))
        assert (context.code, context.details) == (
            grpc.StatusCode.INVALID_ARGUMENT, "regex: the regex cannot be compiled: Regex parsing error at position "
                                              "2: The parenthesis is not closed.")
        assert server.admission.in_flight == 1
        server.admission.in_flight = 0


# ---- no silent drops --------------------------------------------------------------------------------
# A value that asks each refused field for something tandem does not do.
REFUSED = {
    "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "service_tier": "flex", "store": True, "metadata": {"run": "7"}, "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"}, "prompt_cache_key": "user-7",
    "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "24h", "safety_identifier": "u-7",
    "suffix": "}", "use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "allowed_token_ids": [1],
    "bad_words": ["no"], "truncate_prompt_tokens": 8, "truncation_side": "left", "logits_processors": ["x"],
    "priority": 1, "spaces_between_special_tokens": False, "add_generation_prompt": False,
    "continue_final_message": True, "chat_template": "{{ x }}", "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "a", "text": "b"}], "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"image": {}},
    "return_tokens_as_token_ids": True, "return_token_ids": True, "logprob_token_ids": [1], "cache_salt": "s",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "thinking_token_budget": 10,
    "repetition_detection": {"n": 3}, "structural_tag": "{}",
}
# Values that ask for nothing, accepted.
ACCEPTED = {"modalities": ["text"], "service_tier": "auto", "store": False, "metadata": {}, "suffix": "",
            "use_beam_search": False, "length_penalty": 1.0, "priority": 0, "spaces_between_special_tokens": True,
            "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
            "return_tokens_as_token_ids": False, "return_token_ids": False, "bad_words": [], "audio": None}


def test_every_openai_request_field_is_honoured_or_refused() -> None:
    """Every field the openai package sends is a request model's field or refused by name."""
    for openai_fields, model in ((completion_params.CompletionCreateParamsStreaming.__annotations__, CompletionRequest),
                                 (chat_params.CompletionCreateParamsStreaming.__annotations__, ChatCompletionRequest)):
        honoured = model.model_fields.keys() | TOOL_FIELDS
        assert sorted(set(openai_fields) - honoured - UNSUPPORTED.keys()) == []
        assert sorted(model.model_fields.keys() & UNSUPPORTED.keys()) == []  # a refusal a field would shadow


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_refused_field_is_a_400_naming_it(http, group, name) -> None:
    assert sorted(REFUSED) == sorted(UNSUPPORTED)
    before = len(group.calls)
    for path in (COMPLETIONS, CHAT):
        assert error(post(http, path, {name: REFUSED[name]})) == (
            name, f"{name}: not supported: {UNSUPPORTED[name].why}", "unsupported_parameter")
    assert len(group.calls) == before
    if name in ACCEPTED:
        for path in (COMPLETIONS, CHAT):
            assert post(http, path, {name: ACCEPTED[name]}).status_code == 200


def test_stream_obfuscation_is_refused_and_its_off_value_accepted(http) -> None:
    body = {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}
    assert error(post(http, CHAT, body))[:2] == ("stream_options",
                                                 "stream_options.include_obfuscation: Input should be False")
    body["stream_options"]["include_obfuscation"] = False
    assert post(http, CHAT, body).status_code == 200


def test_fields_no_api_defines_are_logged_once_per_request(http, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.router.ingress")
    assert post(http, COMPLETIONS, {"frobnicate": {"a": 1}, "zeal": 1}).status_code == 200
    assert post(http, CHAT, {"user": "u", "seed": 3}).status_code == 200  # honoured fields: no line
    many = {f"x{i:02d}": i for i in range(20)} | {"line\nbreak": 1, "k" * 100: 2}
    assert post(http, COMPLETIONS, many).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.router.ingress"]
    assert lines == ["/v1/completions: ignored fields that no API defines: frobnicate, zeal",
                     "/v1/completions: ignored fields that no API defines: " + "'" + "k" * 64 + "'..., "
                     "'line\\nbreak', " + ", ".join(f"x{i:02d}" for i in range(14)) + " and 6 more"]


# ---- /tokenize and /detokenize ----------------------------------------------------------------------
def test_tokenize_a_prompt_as_the_tokenizer_does(http, tokenizer) -> None:
    text = "Hello world, tokenize me"
    ids = list(tokenizer(text).input_ids)
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    bare = list(tokenizer(text, add_special_tokens=False).input_ids)
    assert r.json() == {"count": len(bare), "max_model_len": 64, "tokens": bare,
                        "token_strs": tokenizer.convert_ids_to_tokens(bare)}
    assert bare == ids[1:]  # the BOS, and nothing else, is the tokenizer's own


def test_tokenize_a_chat_as_the_chat_route_renders_it(http, tokenizer, group) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    rendered = {}
    for add_generation_prompt in (True, False):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        r = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": add_generation_prompt})
        assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
        rendered[add_generation_prompt] = (text, ids)
    assert rendered[True][1] != rendered[False][1]
    assert post(http, CHAT, {"messages": messages}).status_code == 200
    assert group.calls[-1].prompt_token_ids == rendered[True][1]  # what the chat route sends its group
    r = http.post("/tokenize", json={"messages": messages, "add_special_tokens": True})
    assert r.json()["tokens"] == list(tokenizer(rendered[True][0]).input_ids)


def test_detokenize_round_trips_the_tokenizer(http, tokenizer) -> None:
    text = "Round <|im_start|> trip, é and 你好"
    ids = list(tokenizer(text).input_ids)
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert (r.status_code, r.json()) == (200, {"prompt": tokenizer.decode(ids)})
    tokens = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": tokenizer.decode(ids)}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/detokenize", {"tokens": [5, 512]}, 400, "tokens",
     "tokens: token id 512 is not in this model's vocabulary (its ids are below 512)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "tokens.0: Input should be greater than or equal to 0"),
    ("/detokenize", {}, 400, "tokens", "tokens: Field required"),
    ("/tokenize", {}, 400, "prompt", "prompt: Field required"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "prompt: Input should be a valid string"),
    ("/tokenize", {"messages": []}, 400, "messages", "messages: List should have at least 1 item after validation, "
                                                     "not 0"),
    ("/tokenize", {"prompt": "x" * 40_000}, 400, "prompt",
     "prompt: this model's maximum context length is 64 tokens, but the text has 40000 characters, more than that "
     "many tokens can hold"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, 400, "chat_template",
     "chat_template: not supported: tandem uses the model's own chat template"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model",
     "the model 'gpt-4o' does not exist (this server has 'tiny')"),
], ids=["past-vocab", "negative", "no-tokens", "no-prompt", "prompt-type", "no-messages", "too-long", "template",
        "model"])
def test_tokenization_errors(http, path, body, status, param, message) -> None:
    assert error(http.post(path, json=body), status)[:2] == (param, message)


def test_tokenization_routes_take_the_key_and_the_body_bound(tiny_llama) -> None:
    server = ingress_server(tiny_llama, EchoGroup(), api_key="sesame", limits={"max_body_bytes": 1024})
    with serving(server) as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert error(http.post(path, json=body), 401)[2] == "invalid_api_key"
            key = {"authorization": "Bearer sesame"}
            assert http.post(path, json=body, headers=key).status_code == 200
            assert error(http.post(path, json={"prompt": "x" * 2000, "tokens": [1] * 600}, headers=key),
                         413)[2] == "request_too_large"


# ---- gRPC ------------------------------------------------------------------------------------------
def generate(server, sampling: pb.SamplingParams, streaming: bool = False) -> tuple[FakeGrpcContext, list]:
    request = pb.GenerateRequest(text="hi", sampling=sampling)
    context = FakeGrpcContext()

    async def call() -> list:
        if streaming:
            try:
                return [m async for m in server.GenerateStream(request, context)]
            except Exception:  # noqa: BLE001 - a stream raises after setting its status
                return []
        return [await server.Generate(request, context)]

    return context, asyncio.run(call())


@pytest.mark.parametrize("sampling, spec", [
    (pb.SamplingParams(json_schema='{"type": "object"}'), StructuredSpec("json", '{"type": "object"}')),
    (pb.SamplingParams(json_object=True), StructuredSpec("json_object")),
    (pb.SamplingParams(json_object=False), None),
    (pb.SamplingParams(regex="[ab]+"), StructuredSpec("regex", "[ab]+")),
    (pb.SamplingParams(choice=pb.Choices(choices=["yes", "no"])), StructuredSpec.choice(["yes", "no"])),
    (pb.SamplingParams(grammar='root ::= "a"'), StructuredSpec("grammar", 'root ::= "a"')),
    (pb.SamplingParams(), None),
], ids=["json_schema", "json_object", "json_object-false", "regex", "choice", "grammar", "none"])
def test_grpc_structured_fields_reach_the_group(server, group, sampling, spec) -> None:
    for streaming in (False, True):
        context, replies = generate(server, sampling, streaming)
        assert context.code is None and replies, context.details
        assert group.calls[-1].sampling.structured == spec


def test_grpc_logit_bias_reaches_the_group(server, group) -> None:
    context, _ = generate(server, pb.SamplingParams(logit_bias={511: 100.0, 0: -100.0, 7: 2.5}))
    assert context.code is None
    assert group.calls[-1].sampling.logit_bias == {511: 100.0, 0: -100.0, 7: 2.5}


@pytest.mark.parametrize("sampling, details", [
    (pb.SamplingParams(regex="("),
     "regex: the regex cannot be compiled: Regex parsing error at position 2: The parenthesis is not closed."),
    (pb.SamplingParams(json_schema="{not json"), "json_schema: the JSON schema cannot be compiled: not JSON "
     "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (pb.SamplingParams(json_schema='{"type": "nope"}'),
     'json_schema: the JSON schema cannot be compiled: Unsupported type "nope"'),
    (pb.SamplingParams(grammar="root ::= foo"),
     'grammar: the grammar cannot be compiled: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    (pb.SamplingParams(regex="[^\\x00-\\U0010FFFF]"), "regex: the regex admits no output"),
    (pb.SamplingParams(choice=pb.Choices()), "choice: choice must be a non-empty list of non-empty strings"),
    (pb.SamplingParams(regex=""), "regex: the regex is empty"),
    (pb.SamplingParams(logit_bias={512: 1.0}),
     "logit_bias: token id 512 is not in this model's vocabulary (its ids are below 512)"),
    (pb.SamplingParams(logit_bias={-1: 1.0}), "logit_bias: keys must be token ids (integers >= 0), got -1"),
    (pb.SamplingParams(logit_bias={3: 101.0}), "logit_bias: values must be numbers in [-100, 100], got 101.0 for "
                                               "token 3"),
    (pb.SamplingParams(logit_bias={i: 1.0 for i in range(301)}), "logit_bias: must map at most 300 token ids to "
                                                                 "biases"),
], ids=["regex", "not-json", "schema-type", "grammar", "admits-nothing", "no-choices", "empty-regex", "bias-vocab",
        "bias-negative-id", "bias-range", "bias-count"])
def test_grpc_bad_structure_is_invalid_argument_naming_the_field(server, group, sampling, details) -> None:
    before = len(group.calls)
    for streaming in (False, True):
        context, _ = generate(server, sampling, streaming)
        assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert len(group.calls) == before


def test_the_openai_clients_parse_asks_for_its_models_schema(http, group) -> None:
    """`client.chat.completions.parse(response_format=Model)` sends OpenAI's strict json_schema: it
    reaches the group as that schema (the fake group stops at its length: the client refuses to parse)."""
    import openai
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        celsius: int

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather, max_tokens=2)
    spec = group.calls[-1].sampling.structured
    assert spec.kind == "json"
    assert json.loads(spec.value) == {"additionalProperties": False, "required": ["city", "celsius"], "type": "object",
                                      "title": "Weather", "properties": {"city": {"title": "City", "type": "string"},
                                                                         "celsius": {"title": "Celsius",
                                                                                     "type": "integer"}}}
