"""Security defaults: keys compared in constant time, nothing of the server in an error,
and an embedded Ray that listens on loopback with token authentication on."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
from unittest import mock

import grpc
import pytest

from tandem.router import tandem_pb2 as pb
from tests.serve.fake_group import EchoGroup, FakeGrpcContext, ingress_server, serving

KEY = "sesame"
PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
SECRET = "/srv/secret/tandem/engine.py line 12: boom"


@pytest.fixture(scope="module")
def served(tiny_llama):
    group = EchoGroup()
    server = ingress_server(tiny_llama, group, api_key=KEY, admission={"max_requests_per_group": 8})
    with serving(server) as client:
        yield server, client, group


def test_the_api_key_is_compared_in_constant_time_on_http_and_grpc(served):
    server, client, _ = served
    # The ingress holds the key's digest only, and compares the presented key's with it.
    assert server.api_key == hashlib.sha256(KEY.encode()).hexdigest() and KEY not in repr(vars(server))
    nope, key = (hashlib.sha256(k.encode()).hexdigest().encode() for k in ("nope", KEY))
    with mock.patch.object(hmac, "compare_digest", wraps=hmac.compare_digest) as compare:
        assert client.post("/v1/completions", json=PROMPT, headers={"authorization": "Bearer nope"}).status_code == 401
        assert compare.call_args.args == (nope, key)
        assert client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert compare.call_args.args == (key, key)
        context = FakeGrpcContext([("authorization", "Bearer nope")])
        asyncio.run(server.ModelInfo(pb.ModelInfoRequest(), context))
        assert context.code == grpc.StatusCode.UNAUTHENTICATED
        assert compare.call_args.args == (nope, key)
        assert compare.call_count == 3


def test_an_internal_error_says_only_its_id(served, caplog):
    server, client, group = served
    group.fail_with = RuntimeError(SECRET)
    with caplog.at_level(logging.ERROR, logger="tandem.router.errors"):
        response = client.post("/v1/completions", json=PROMPT, headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 500
    error = response.json()["error"]
    match = re.fullmatch(r"internal error \(id ([0-9a-f]{16})\)", error["message"])
    assert match and (error["type"], error["param"], error["code"]) == ("server_error", None, "internal_error")
    assert "secret" not in response.text and "RuntimeError" not in response.text
    record = next(r for r in caplog.records if match.group(1) in r.getMessage())  # the log has it all
    assert SECRET in str(record.exc_info[1])
    assert server.admission.in_flight == 0


def test_an_internal_grpc_error_says_only_its_id(served):
    server, _, group = served
    group.fail_with = RuntimeError(SECRET)
    context = FakeGrpcContext([("authorization", KEY)])
    assert asyncio.run(server.Generate(pb.GenerateRequest(text="hi"), context)) == pb.GenerateResponse()
    assert context.code == grpc.StatusCode.INTERNAL
    assert re.fullmatch(r"internal error \(id [0-9a-f]{16}\)", context.details)
    assert server.admission.in_flight == 0


def test_unknown_paths_and_methods_answer_in_openai_shape(served):
    _, client, _ = served
    response = client.get("/v1/nothing")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")
    response = client.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "method not allowed on this endpoint"


def test_admin_kv_needs_a_key_and_is_off_without_one(served, tiny_llama):
    _, client, _ = served
    with mock.patch("tandem.router.ingress.kv_holdings", return_value={"groups": {}}):
        assert client.get("/admin/kv").status_code == 401
        assert client.get("/admin/kv", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/admin/kv", headers={"Authorization": f"Bearer {KEY}"}).json() == {"groups": {}}
    with serving(ingress_server(tiny_llama, EchoGroup())) as keyless:
        response = keyless.get("/admin/kv")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert "without an API key" in response.json()["error"]["message"]


def test_embedded_ray_listens_on_loopback_with_token_auth(monkeypatch):
    from ray._private import ray_constants

    from tandem.cli.main import build_parser
    from tandem.cli.serve import local_ray_init_kwargs

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # restored after the test
    for name in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        # Set, then removed: monkeypatch records a variable only when it is there, and only what
        # it recorded is put back, so what local_ray_init_kwargs sets ends with the test (else
        # every later test and `ray start` inherits token auth and no cluster address).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve"])
    assert local_ray_init_kwargs(args, 4) == {"address": "local", "num_cpus": 4, "_node_ip_address": "127.0.0.1",
                                              "include_dashboard": True, "dashboard_host": "127.0.0.1"}
    assert ray_constants.ENABLE_RAY_CLUSTER is False  # else Ray swaps loopback for the machine's IP
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    args = build_parser().parse_args(["serve", "--ray-bind-host", "10.1.2.3", "--dashboard-host", "0.0.0.0",
                                      "--no-dashboard"])
    assert local_ray_init_kwargs(args, 2) == {"address": "local", "num_cpus": 2, "_node_ip_address": "10.1.2.3",
                                              "include_dashboard": False, "dashboard_host": "0.0.0.0"}
    assert ray_constants.ENABLE_RAY_CLUSTER is True
