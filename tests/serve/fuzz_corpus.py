"""The HTTP fuzzer's requests, drawn once from the published /openapi.json and kept in
tests/serve/fuzz_corpus.pickle.gz, so the fuzzer spends its time on the server's answers.

Drawing 2,000 requests through schemathesis and hypothesis takes most of the fuzzer's time;
sending them to the in-process ingress and checking every answer takes a tenth of it. The
corpus holds each request as schemathesis drew it (its parts and its generation metadata,
which the negative-data check reads), with the digest of the document it was drawn from.
When the document changes (a field, a bound, an error), the corpus no longer matches and
test_fuzz_http.py says so; draw it again with

    python3 -m tests.serve.fuzz_corpus
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis.generation.case import Case
from schemathesis.generation.modes import GenerationMode

PATH = Path(__file__).with_name("fuzz_corpus.pickle.gz")
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Requests drawn per (operation, mode); the GETs take no input, one request each.
BUDGET = {("POST /v1/completions", POSITIVE): 800, ("POST /v1/completions", NEGATIVE): 500,
          ("POST /v1/chat/completions", POSITIVE): 400, ("POST /v1/chat/completions", NEGATIVE): 300,
          ("POST /tokenize", POSITIVE): 100, ("POST /tokenize", NEGATIVE): 60,
          ("POST /detokenize", POSITIVE): 60, ("POST /detokenize", NEGATIVE): 40,
          ("GET /v1/models", POSITIVE): 1, ("GET /health", POSITIVE): 1,
          ("GET /live", POSITIVE): 1}
SEED = 18  # the same requests every draw


def digest(schema: Any) -> str:
    """Of the document the requests are drawn from, and of how many are drawn."""
    document = json.dumps(schema.raw_schema, sort_keys=True)
    budget = sorted((label, mode.value, n) for (label, mode), n in BUDGET.items())
    return hashlib.sha256(f"{document}|{budget}|{SEED}".encode()).hexdigest()


def draw(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """(operation label, a request's parts) for every request of the budget."""
    drawn: list[tuple[str, dict[str, Any]]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (POSITIVE, NEGATIVE):
            budget = BUDGET.get((operation.label, mode))
            if budget is not None:
                drawn += [(operation.label, parts) for parts in _draw(operation, mode, budget)]
    return drawn


def _draw(operation: Any, mode: GenerationMode, budget: int) -> list[dict[str, Any]]:
    drawn: list[dict[str, Any]] = []

    @seed(SEED)
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=budget, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def keep(case: Case) -> None:
        drawn.append(_parts(case))

    keep()
    return drawn


def load(schema: Any) -> list[Case] | None:
    """The corpus's requests as cases of `schema`'s operations; None when there is no corpus, it
    was drawn from another document, or this schemathesis cannot read it back."""
    if not PATH.exists():
        return None
    try:
        with gzip.open(PATH, "rb") as f:
            stored = pickle.load(f)  # our own file, written by save()
    except Exception:  # noqa: BLE001 - another schemathesis's classes: draw again
        return None
    if stored["digest"] != digest(schema):
        return None
    return cases(schema, stored["requests"])


def cases(schema: Any, drawn: list[tuple[str, dict[str, Any]]]) -> list[Case]:
    """The drawn requests as cases of `schema`'s operations, ready to call and check."""
    operations = {result.ok().label: result.ok() for result in schema.get_all_operations()}
    return [_case(operations[label], parts) for label, parts in drawn]


def save(schema: Any, drawn: list[tuple[str, dict[str, Any]]]) -> None:
    with gzip.open(PATH, "wb", compresslevel=9) as f:
        pickle.dump({"digest": digest(schema), "requests": drawn}, f, protocol=pickle.HIGHEST_PROTOCOL)


def _parts(case: Case) -> dict[str, Any]:
    return {"method": case.method, "path_parameters": case.path_parameters, "headers": dict(case.headers),
            "cookies": case.cookies, "query": case.query, "body": case.body, "media_type": case.media_type,
            "meta": case.meta}


def _case(operation: Any, parts: dict[str, Any]) -> Case:
    return Case(operation, parts["method"], operation.path, path_parameters=parts["path_parameters"],
                headers=parts["headers"], cookies=parts["cookies"], query=parts["query"], body=parts["body"],
                media_type=parts["media_type"], meta=parts["meta"])


if __name__ == "__main__":
    import schemathesis

    from tandem.router import ingress
    from tests.conftest import tiny_model
    from tests.serve.fake_group import EchoGroup, ingress_server, serving

    with serving(ingress_server(tiny_model("llama"), EchoGroup())):
        document = schemathesis.openapi.from_asgi("/openapi.json", ingress.app)
        requests = draw(document)
        save(document, requests)
    print(f"{len(requests)} requests drawn into {PATH} ({PATH.stat().st_size} bytes)")
