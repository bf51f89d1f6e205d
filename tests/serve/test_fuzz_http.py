"""schemathesis against the published /openapi.json: thousands of generated requests, in process.

Requests come from the document itself (router/openapi.py), schema-valid ones and ones
that break it on purpose, drawn once into a corpus (tests/serve/fuzz_corpus.py), and go to
the real FastAPI ingress over ASGI with a fake replica group (tests/serve/fake_group.py),
so 2,000 of them take seconds. Every answer
is held to the document: no 5xx, a documented status and content type, a body (or every
SSE event of a stream) that matches its schema, Retry-After where declared, and every
schema-invalid request refused with a 4xx.

Not checked: that every schema-valid request is accepted. Some limits depend on the
model and on the tokens (the context length, the vocabulary), which no static schema
states; those answer 400 with the numbers (test_hostile_inputs.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from schemathesis import checks

from tandem.router import ingress
from tests.serve import fuzz_corpus
from tests.serve.fake_group import EchoGroup, ingress_server, serving

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection]
MIN_REQUESTS = 2000


@pytest.fixture(scope="module")
def schema(tiny_llama):
    server = ingress_server(tiny_llama, EchoGroup(), admission={"max_requests_per_group": 1000})
    with serving(server):
        yield schemathesis.openapi.from_asgi("/openapi.json", ingress.app)


def test_the_document_states_every_route_and_its_errors(schema):
    raw = schema.raw_schema
    assert sorted(raw["paths"]) == ["/detokenize", "/health", "/live", "/tokenize", "/v1/chat/completions",
                                    "/v1/completions", "/v1/models"]
    completions = raw["paths"]["/v1/completions"]["post"]
    assert sorted(completions["responses"]) == ["200", "400", "401", "404", "408", "413", "415", "429", "500", "503"]
    assert completions["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    request = raw["components"]["schemas"]["CompletionRequest"]
    assert request["required"] == ["prompt"]
    assert request["properties"]["n"] == {"default": 1, "maximum": 128, "minimum": 1, "title": "N", "type": "integer"}


def test_the_corpus_was_drawn_from_this_document(schema):
    assert fuzz_corpus.load(schema) is not None, (
        "tests/serve/fuzz_corpus.pickle.gz was drawn from another /openapi.json (or cannot be read here): "
        "draw it again with `python3 -m tests.serve.fuzz_corpus` and commit it")


def test_generated_requests_get_only_documented_answers(schema):
    cases = fuzz_corpus.load(schema)
    if cases is None:  # a stale corpus (the test above fails): the requests are drawn here instead
        cases = fuzz_corpus.cases(schema, fuzz_corpus.draw(schema))
    statuses: Counter[int] = Counter()
    for case in cases:
        response = case.call()
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
    total = sum(statuses.values())
    print(f"schemathesis: {total} requests, by status {dict(sorted(statuses.items()))}")
    assert total >= MIN_REQUESTS
    assert sum(n for status, n in statuses.items() if status >= 500) == 0
    assert statuses[200] > 0 and statuses[400] > 0
