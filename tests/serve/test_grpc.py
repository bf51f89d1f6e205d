"""The gRPC API through Ray Serve's gRPC proxy, with a real grpc client built from the proto.

Most tests run `GrpcMethods` in a small ingress over a fake EngineClient (canned deltas,
errors on cue); the last one serves the real app on a tiny model and checks greedy
output against the offline engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sys

import grpc
import pytest
from ray import cloudpickle, serve

from tandem.router import tandem_pb2 as pb
from tandem.router import tandem_pb2_grpc as pb_grpc
from tandem.router.admission import NoGroupUp
from tandem.router.api_key import key_digest
from tandem.router.engine_client import ServiceUnavailable
from tandem.router.grpc_service import GrpcMethods
from tandem.router.limits import RequestLimits
from tandem.router.text_work import TextWork
from tandem.workers.core.request import CompletionOutput, Logprob, SamplingParams
from tandem.workers.core.validation import PromptLimits, validate_prompt
from tandem.workers.serving.messages import GroupDelta, GroupRequest
from tandem.workers.structured.spec import StructuredSpec
from tests.serve.conftest import wait_for
from tests.serve.hostile_cases import GRPC_CASES

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

FAKE_APP = "fake"
API_KEY = "sesame"
AUTH = ("authorization", f"Bearer {API_KEY}")
BOS = 1
# Cues: a prompt ending in one of these ids makes the fake client fail.
UNAVAILABLE_AT_START, UNAVAILABLE_MID_STREAM, CLIENT_VALUE_ERROR = 900, 901, 902
NO_GROUP_UP, UNPICKLABLE_ERROR, ENDLESS = 903, 904, 905  # ENDLESS: deltas until the request is cancelled


class UnpicklableError(Exception):
    """An unexpected error that pickle cannot re-create (its __init__ wants what args lacks)."""

    def __init__(self, message: str, *, where: str) -> None:
        super().__init__(message)
        self.where = where

# The fake classes live in this module, which Ray workers cannot import: send them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FakeTokenizer:
    """Text -> [BOS] + code points."""

    class _Encoding:
        def __init__(self, input_ids: list[int]) -> None:
            self.input_ids = input_ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return self._Encoding(([BOS] if add_special_tokens else []) + [ord(c) for c in text])

    def __len__(self) -> int:
        return 300

    def get_vocab(self) -> dict[str, int]:  # one character a token
        return {chr(i): i for i in range(300)}


class FakeGrammarCheck:
    """Refuses the regex "(" as router/grammar_check.py does (the fake tokenizer is no HF one)."""

    async def check(self, spec: StructuredSpec, field: str) -> None:
        if spec.kind == "regex" and spec.value == "(":
            raise ValueError(f"{field}: the regex cannot be compiled: Regex parsing error at position 2: The "
                             "parenthesis is not closed.")


class FakeEngineClient:
    """Completion i's token at step s is 100 * i + 10 + s, its text "<i.s>".

    A prompt that starts with BOS (any text prompt) is echoed instead: one finished delta
    whose text is the JSON of what the client received.
    """

    model_name = "fake-model"
    max_model_len = 64
    vocab_size = 1000

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.text = TextWork(self.tokenizer, self.max_model_len)
        self.grammar = FakeGrammarCheck()
        self.healthy = True
        self.num_endless = 0  # ENDLESS streams running now

    async def health(self) -> dict:
        return {"ready": self.healthy, "all_healthy": self.healthy, "groups": {}}

    def request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                final_only: bool = False, field: str = "prompt") -> GroupRequest:
        """Checked as EngineClient checks it."""
        limits = PromptLimits(self.vocab_size, self.max_model_len, max_tokens_must_fit=True)
        validate_prompt(prompt_token_ids, params, limits, field)
        return GroupRequest(request_id, list(prompt_token_ids), params, final_only=final_only)

    async def stream(self, request: GroupRequest, deadline: float | None = None):
        prompt_token_ids, sampling, request_id = request.prompt_token_ids, request.sampling, request.request_id
        cue = prompt_token_ids[-1]
        if cue == UNAVAILABLE_AT_START:
            raise ServiceUnavailable("every replica group is busy")
        if cue == CLIENT_VALUE_ERROR:
            raise ValueError(f"prompt: token id {cue} is reserved")
        if cue == NO_GROUP_UP:
            raise NoGroupUp("no replica group is running", 3)
        if cue == UNPICKLABLE_ERROR:
            raise UnpicklableError("/secret/path exploded", where="/secret/path")
        if cue == ENDLESS:
            self.num_endless += 1
            try:
                for step in itertools.count():
                    await asyncio.sleep(0.001)
                    yield _delta(request_id, [_output(0, f"<0.{step}>", [10 + step], None)], False, 0)
            finally:
                self.num_endless -= 1
        if prompt_token_ids[0] == BOS:
            echo = {"prompt_token_ids": prompt_token_ids, "sampling": dataclasses.asdict(sampling),
                    "request_id": request_id, "final_only": request.final_only}
            yield _delta(request_id, [_output(0, json.dumps(echo, sort_keys=True), [], "stop")], True, 0)
            return
        num_steps = sampling.max_tokens or 3
        stop_ids = sampling.stop_token_ids
        whole: dict[int, CompletionOutput] = {}  # final_only: each completion's outputs so far, sent once at the end
        for step in range(num_steps):
            await asyncio.sleep(0.005)
            if cue == UNAVAILABLE_MID_STREAM and step == 1:
                raise ServiceUnavailable("the replica group failed")
            last = step == num_steps - 1
            outputs = []
            for i in range(sampling.n):
                token = 100 * i + 10 + step
                out = _output(i, f"<{i}.{step}>", [token], None)
                if sampling.logprobs is not None:
                    # The chosen token ranks 2nd; the position holds it plus the top alternatives.
                    out.logprobs = [{token: Logprob(-0.5, 2, f"<{i}.{step}>"), token + 1: Logprob(-0.25, 1, "alt1"),
                                     token + 2: Logprob(-3.0, 3, "alt3")}]
                if last:
                    out.finish_reason = "stop" if stop_ids else "length"
                    out.stop_reason = stop_ids[0] if stop_ids else None
                outputs.append(out)
            if not request.final_only:
                yield _delta(request_id, outputs, last, num_cached_tokens=2)
                continue
            for out in outputs:
                so_far = whole.setdefault(out.index, _output(out.index, "", [], None))
                whole[out.index] = dataclasses.replace(
                    so_far, text=so_far.text + out.text, token_ids=so_far.token_ids + out.token_ids,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    logprobs=so_far.logprobs if out.logprobs is None else (so_far.logprobs or []) + out.logprobs)
        if request.final_only:
            yield _delta(request_id, [whole[i] for i in sorted(whole)], True, num_cached_tokens=2)


def _output(index: int, text: str, token_ids: list[int], finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(index, text, token_ids, None, finish_reason=finish_reason)


def _delta(request_id: str, outputs: list[CompletionOutput], finished: bool, num_cached_tokens: int,
           num_prompt_tokens: int = 3) -> GroupDelta:
    return GroupDelta(request_id, "g0", outputs, finished, num_prompt_tokens=num_prompt_tokens,
                      num_cached_tokens=num_cached_tokens)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class FakeIngress(GrpcMethods):
    def __init__(self, api_key: str | None) -> None:
        self.client = FakeEngineClient()
        self.api_key = key_digest(api_key) if api_key else None  # as build_app hands it on
        self.limits = RequestLimits()

    def set_healthy(self, healthy: bool) -> None:
        self.client.healthy = healthy

    def num_endless(self) -> int:
        return self.client.num_endless


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpc_address(shared_ray):
    """The shared Serve's gRPC proxy (tests/shared_ray.py: tandem's servicer), with the fake app."""
    from tests import shared_ray as instance

    _, port = instance.serve_ports()
    try:
        serve.run(FakeIngress.bind(API_KEY), name=FAKE_APP, route_prefix=f"/{FAKE_APP}")
        address = f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.TandemStub(channel)
            assert wait_for(lambda: _is_up(stub, FAKE_APP), timeout_s=60), "the gRPC proxy never answered"
        yield address
    finally:
        instance.delete_app(FAKE_APP)


@pytest.fixture(scope="module")
def channel(grpc_address: str):
    with grpc.insecure_channel(grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.TandemStub:
    return pb_grpc.TandemStub(channel)


def _is_up(stub: pb_grpc.TandemStub, app: str) -> bool:
    try:
        stub.Health(pb.HealthRequest(), metadata=[("application", app)], timeout=5)
        return True
    except grpc.RpcError:
        return False


def _md(*extra: tuple[str, str], auth: tuple[str, str] | None = AUTH, app: str = FAKE_APP) -> list:
    return [("application", app)] + ([auth] if auth else []) + list(extra)


def _generate(stub, request: pb.GenerateRequest, **md) -> pb.GenerateResponse:
    return stub.Generate(request, metadata=_md(**md), timeout=30)


def _stream(stub, request: pb.GenerateRequest, **md) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(request, metadata=_md(**md), timeout=30))


def _ids(*ids: int) -> pb.TokenIds:
    return pb.TokenIds(ids=list(ids))


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---- tests ------------------------------------------------------------------------------------------
def test_generate_returns_the_whole_completion(stub) -> None:
    out = _generate(stub, pb.GenerateRequest(token_ids=_ids(5, 6, 7), request_id="r-1",
                                             sampling=pb.SamplingParams(max_tokens=3)))
    assert out.request_id == "r-1" and out.model == "fake-model"
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text == "<0.0><0.1><0.2>" and list(choice.token_ids) == [10, 11, 12]
    assert choice.finish_reason == "length" and choice.WhichOneof("stop_reason") is None
    assert not choice.logprobs
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens,
            out.usage.cached_tokens) == (3, 3, 6, 2)


def test_generate_n_logprobs_and_stop_reason(stub) -> None:
    sampling = pb.SamplingParams(max_tokens=2, n=2, logprobs=1, stop_token_ids=[77])
    out = _generate(stub, pb.GenerateRequest(token_ids=_ids(5, 6), sampling=sampling))
    assert out.request_id.startswith("grpc-")
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == ["<0.0><0.1>", "<1.0><1.1>"]
    assert [list(c.token_ids) for c in out.choices] == [[10, 11], [110, 111]]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
    assert [c.stop_token_id for c in out.choices] == [77, 77]
    assert out.usage.completion_tokens == 4
    first = out.choices[1].logprobs[0]
    assert (first.token_id, first.token, first.logprob, first.rank) == (110, "<1.0>", -0.5, 2)
    assert [(t.token_id, t.token, t.logprob) for t in first.top_logprobs] == [(111, "alt1", -0.25)]
    assert len(out.choices[0].logprobs) == 2


def test_text_prompt_is_tokenized_and_sampling_fields_reach_the_client(stub) -> None:
    sampling = pb.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, n=1, stop=["x", "yz"],
                                 seed=-3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                 logprobs=0, ignore_eos=True, min_tokens=2, include_stop_str_in_output=True,
                                 skip_special_tokens=False)
    out = _generate(stub, pb.GenerateRequest(text="hi", model="fake-model", request_id="echo", sampling=sampling))
    echo = json.loads(out.choices[0].text)
    assert echo["prompt_token_ids"] == [BOS, ord("h"), ord("i")]
    # The client's id is a label (echoed in the response); the engine's is the server's own.
    assert echo["request_id"].startswith("grpc-") and out.request_id == "echo"
    assert echo["final_only"] is True  # Generate answers once: its group sends one delta, at the end
    assert echo["sampling"] == dataclasses.asdict(SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, n=1, stop=["x", "yz"],
        seed=-3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=0,
        ignore_eos=True, min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False))
    # Unset fields stay unset: the engine's defaults apply.
    out = _generate(stub, pb.GenerateRequest(text="hi"))
    assert json.loads(out.choices[0].text)["sampling"] == dataclasses.asdict(SamplingParams())


def test_structured_fields_and_logit_bias_cross_the_proxy(stub) -> None:
    for sampling, expected in (
            (pb.SamplingParams(regex="[ab]+", logit_bias={5: 1.5, 0: -100.0}),
             SamplingParams(structured=StructuredSpec("regex", "[ab]+"), logit_bias={5: 1.5, 0: -100.0})),
            (pb.SamplingParams(json_schema='{"type": "object"}'),
             SamplingParams(structured=StructuredSpec("json", '{"type": "object"}'))),
            (pb.SamplingParams(choice=pb.Choices(choices=["yes", "no"])),
             SamplingParams(structured=StructuredSpec.choice(["yes", "no"]))),
            (pb.SamplingParams(json_object=True), SamplingParams(structured=StructuredSpec("json_object"))),
            (pb.SamplingParams(grammar='root ::= "a"'), SamplingParams(structured=StructuredSpec("grammar",
                                                                                                'root ::= "a"')))):
        out = _generate(stub, pb.GenerateRequest(text="hi", sampling=sampling))
        # JSON's keys are strings: the expected side goes through JSON too.
        assert json.loads(out.choices[0].text)["sampling"] == json.loads(json.dumps(dataclasses.asdict(expected)))
    for call in (_generate, _stream):
        err = _error(lambda call=call: call(stub, pb.GenerateRequest(token_ids=_ids(5),
                                                                     sampling=pb.SamplingParams(regex="("))))
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "regex: the regex cannot be compiled: "
                                               "Regex parsing error at position 2: The parenthesis is not closed.")


def test_generate_stream_sends_deltas_then_usage(stub) -> None:
    messages = _stream(stub, pb.GenerateRequest(token_ids=_ids(5, 6, 7), request_id="s-1",
                                                sampling=pb.SamplingParams(max_tokens=4)))
    assert len(messages) == 4
    assert all(m.request_id == "s-1" and m.model == "fake-model" for m in messages)
    assert [m.choices[0].text for m in messages] == ["<0.0>", "<0.1>", "<0.2>", "<0.3>"]
    assert [list(m.choices[0].token_ids) for m in messages] == [[10], [11], [12], [13]]
    assert [m.finished for m in messages] == [False, False, False, True]
    assert [m.choices[0].finish_reason for m in messages] == ["", "", "", "length"]
    assert not any(m.HasField("usage") for m in messages[:-1])
    assert (messages[-1].usage.prompt_tokens, messages[-1].usage.completion_tokens,
            messages[-1].usage.total_tokens) == (3, 4, 7)
    [echo] = _stream(stub, pb.GenerateRequest(text="hi"))
    assert json.loads(echo.choices[0].text)["final_only"] is False


def test_tokenize(stub) -> None:
    out = stub.Tokenize(pb.TokenizeRequest(text="hey"), metadata=_md(), timeout=30)
    assert list(out.token_ids) == [BOS, ord("h"), ord("e"), ord("y")]
    assert (out.count, out.max_model_len) == (4, 64)
    out = stub.Tokenize(pb.TokenizeRequest(text="hey", add_special_tokens=False), metadata=_md(), timeout=30)
    assert list(out.token_ids) == [ord("h"), ord("e"), ord("y")]


def test_model_info(stub) -> None:
    out = stub.ModelInfo(pb.ModelInfoRequest(), metadata=_md(), timeout=30)
    assert (out.model, out.max_model_len, out.vocab_size) == ("fake-model", 64, 1000)


def test_health_needs_no_key_and_reports_unavailable(stub) -> None:
    assert stub.Health(pb.HealthRequest(), metadata=_md(auth=None), timeout=30).status == "SERVING"
    ingress = serve.get_app_handle(FAKE_APP)
    ingress.set_healthy.remote(False).result()
    try:
        err = _error(lambda: stub.Health(pb.HealthRequest(), metadata=_md(auth=None), timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ingress.set_healthy.remote(True).result()


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("request_kwargs, field", [
    (dict(token_ids=_ids(5), sampling=pb.SamplingParams(top_p=2.0)), "top_p"),
    (dict(token_ids=_ids(5), sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(token_ids=_ids(5), sampling=pb.SamplingParams(logprobs=21)), "logprobs"),
    (dict(token_ids=_ids()), "prompt"),
    (dict(), "prompt"),
    (dict(token_ids=_ids(5, CLIENT_VALUE_ERROR)), "prompt"),  # the client's own ValueError
], ids=["top_p", "max_tokens", "logprobs", "empty", "no-prompt", "client"])
def test_bad_input_is_invalid_argument(stub, streaming: bool, request_kwargs: dict, field: str) -> None:
    call = _stream if streaming else _generate
    err = _error(lambda: call(stub, pb.GenerateRequest(**request_kwargs)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}:"), err.details()


@pytest.mark.parametrize("auth", [None, ("authorization", "Bearer wrong"), ("authorization", "wrong")],
                         ids=["missing", "wrong-bearer", "wrong-bare"])
def test_api_key_is_checked(stub, auth) -> None:
    request = pb.GenerateRequest(token_ids=_ids(5))
    calls = {
        "Generate": lambda: _generate(stub, request, auth=auth),
        "GenerateStream": lambda: _stream(stub, request, auth=auth),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="a"), metadata=_md(auth=auth), timeout=30),
        "ModelInfo": lambda: stub.ModelInfo(pb.ModelInfoRequest(), metadata=_md(auth=auth), timeout=30),
    }
    for name, call in calls.items():
        err = _error(call)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert err.details().startswith("authorization:"), (name, err.details())


def test_bare_api_key_is_accepted(stub) -> None:
    out = _generate(stub, pb.GenerateRequest(token_ids=_ids(5)), auth=("authorization", API_KEY))
    assert out.choices[0].finish_reason == "length"


def test_unknown_model_is_not_found(stub) -> None:
    request = pb.GenerateRequest(token_ids=_ids(5), model="gpt-17")
    for call in (lambda: _generate(stub, request), lambda: _stream(stub, request),
                 lambda: stub.Tokenize(pb.TokenizeRequest(text="a", model="gpt-17"), metadata=_md(), timeout=30)):
        err = _error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert err.details().startswith("model:") and "fake-model" in err.details()


def test_no_group_is_unavailable(stub) -> None:
    request = pb.GenerateRequest(token_ids=_ids(5, UNAVAILABLE_AT_START))
    for call in (lambda: _generate(stub, request), lambda: _stream(stub, request)):
        err = _error(call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "busy" in err.details()
    # Failing mid-stream: the messages sent so far arrive, then the status.
    received = []
    err = _error(lambda: received.extend(stub.GenerateStream(
        pb.GenerateRequest(token_ids=_ids(5, UNAVAILABLE_MID_STREAM)), metadata=_md(), timeout=30)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert [m.choices[0].text for m in received] == ["<0.0>"]


def test_stream_errors_keep_their_code_through_the_proxy(stub) -> None:
    """Serve pickles what a streaming method raises to the proxy; an exception the proxy
    cannot re-create would turn any code into INTERNAL with Ray's insides in the details."""
    err = _error(lambda: _stream(stub, pb.GenerateRequest(token_ids=_ids(5, NO_GROUP_UP))))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "no replica group is running")
    err = _error(lambda: _stream(stub, pb.GenerateRequest(token_ids=_ids(5, UNPICKLABLE_ERROR))))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details().startswith("internal error (id ") and "/secret" not in err.details()


def test_a_stream_the_client_cancels_ends_its_request(stub) -> None:
    """Serve's gRPC proxy cancels the ingress's call only when the client's cancel finds it
    waiting for the next message; when the cancel finds it handing one to gRPC, the call runs
    on. Streams that send a message every millisecond meet both; every one must end."""
    ingress = serve.get_app_handle(FAKE_APP)
    for _ in range(8):
        responses = stub.GenerateStream(pb.GenerateRequest(token_ids=_ids(5, ENDLESS)), metadata=_md(), timeout=60)
        assert [next(responses).choices[0].text for _ in range(3)] == ["<0.0>", "<0.1>", "<0.2>"]
        responses.cancel()
    assert wait_for(lambda: ingress.num_endless.remote().result() == 0, timeout_s=10, interval_s=0.2), \
        f"{ingress.num_endless.remote().result()} of 8 cancelled streams still run"


def test_reflection_lists_describes_and_calls_the_service(channel) -> None:
    """What a generic tool (grpcurl, Postman) does: discover the service, then call it without generated code."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message_factory import GetMessageClass
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    database = ProtoReflectionDescriptorDatabase(channel)
    assert "tandem.v1.Tandem" in database.get_services()
    service = DescriptorPool(database).FindServiceByName("tandem.v1.Tandem")
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name, m.server_streaming) for m in service.methods}
    assert methods == {
        "Generate": ("tandem.v1.GenerateRequest", "tandem.v1.GenerateResponse", False),
        "GenerateStream": ("tandem.v1.GenerateRequest", "tandem.v1.GenerateStreamResponse", True),
        "Tokenize": ("tandem.v1.TokenizeRequest", "tandem.v1.TokenizeResponse", False),
        "ModelInfo": ("tandem.v1.ModelInfoRequest", "tandem.v1.ModelInfoResponse", False),
        "Health": ("tandem.v1.HealthRequest", "tandem.v1.HealthResponse", False),
        "Chat": ("tandem.v1.ChatRequest", "tandem.v1.ChatResponse", False),
        "ChatStream": ("tandem.v1.ChatRequest", "tandem.v1.ChatStreamResponse", True),
    }
    method = service.methods_by_name["Tokenize"]
    request_class, response_class = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    call = channel.unary_unary("/tandem.v1.Tandem/Tokenize", request_serializer=request_class.SerializeToString,
                               response_deserializer=response_class.FromString)
    out = call(request_class(text="ok", add_special_tokens=False), metadata=_md(), timeout=30)
    assert list(out.token_ids) == [ord("o"), ord("k")]


# ---- the real app ----------------------------------------------------------------------------------
def test_real_app_greedy_generate_matches_offline(grpc_address: str, stub) -> None:
    from tandem.cluster.kv_allocator import kill_allocator
    from tandem.router.app import build_app
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM
    from tests import shared_ray
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    serve.run(build_app({"model": model, "group_num_cpus": 1, "kv_cache_memory": 16 << 20}), name="tandem",
              route_prefix="/tandem")
    try:
        assert wait_for(lambda: _is_up(stub, "tandem"), timeout_s=60), "the real app never became healthy"
        prompt = "Hello there, tandem"
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=12)
        out = stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), metadata=_md(auth=None, app="tandem"),
                            timeout=60)
        streamed = list(stub.GenerateStream(pb.GenerateRequest(text=prompt, sampling=sampling),
                                            metadata=_md(auth=None, app="tandem"), timeout=60))
        # A forced tool call: any model's output is held to the tool's schema (xgrammar, strict).
        rain = {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"],
                "additionalProperties": False}
        chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Rain in Oslo?")],
                              tools=[pb.Tool(name="get_rain", parameters=json.dumps(rain))],
                              tool_choice=pb.ToolChoice(function="get_rain"),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=32))
        called = stub.Chat(chat, metadata=_md(auth=None, app="tandem"), timeout=60)
        called_stream = list(stub.ChatStream(chat, metadata=_md(auth=None, app="tandem"), timeout=60))
        # The hostile-input battery's gRPC cases that hold whatever the context and key.
        hostile = [c for c in GRPC_CASES if not any(w in c.name for w in ("context", "too long", "key"))]
        assert len(hostile) == 26
        for case in hostile:
            error = _error(lambda case=case: stub.Generate(case.request, metadata=_md(auth=None, app="tandem"),
                                                           timeout=60))
            assert error.code() == case.code and case.details_has in error.details(), case.name
        assert stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), metadata=_md(auth=None, app="tandem"),
                             timeout=60).choices[0].text == out.choices[0].text  # still serving
    finally:
        shared_ray.delete_app("tandem")
        kill_allocator("tandem")  # detached: it would outlive the app (tests/shared_ray.py hands on clean)

    llm = LLM(model, kv_cache_memory=16 << 20)
    try:
        expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    completion = expected.outputs[0]
    assert out.choices[0].text == completion.text
    assert list(out.choices[0].token_ids) == completion.token_ids
    assert out.choices[0].finish_reason == completion.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert "".join(m.choices[0].text for m in streamed if m.choices) == completion.text
    assert streamed[-1].finished and streamed[-1].usage.completion_tokens == len(completion.token_ids)

    [choice] = called.choices
    [call] = choice.tool_calls
    assert (call.name, call.id[:5], choice.finish_reason, choice.HasField("content")) == (
        "get_rain", "call_", "tool_calls", False)
    assert json.loads(call.arguments) in ({"rain": True}, {"rain": False})
    pieces = [c for m in called_stream for delta in m.choices for c in delta.tool_calls]
    assert (pieces[0].name, pieces[0].id[:5], pieces[0].arguments) == ("get_rain", "call_", "")
    assert "".join(p.arguments for p in pieces) == call.arguments  # greedy: the same call, in pieces
    assert [c.finish_reason for m in called_stream for c in m.choices if c.finish_reason] == ["tool_calls"]
