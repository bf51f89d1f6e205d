"""tandem's gRPC API (router/tandem.proto) as methods of the Serve ingress deployment.

Ray Serve's gRPC proxy calls the ingress method whose name equals the RPC's, passing the
request proto and a `grpc_context`. `OpenAIIngress` inherits `GrpcMethods` and provides
`self.client` (an EngineClient) and `self.api_key`.

Errors: a method sets the status code and details on `grpc_context`. A unary method then
returns an empty response: the proxy copies the context's code onto the call. A streaming
method raises instead, because the proxy only copies the context when a message goes out;
raising after `set_code` makes Serve keep the code (`gRPCStatusError`) rather than INTERNAL.
What it raises is always an `RpcError` (code and details in its args): Serve pickles the
exception to the proxy, and one the proxy cannot unpickle becomes INTERNAL whatever the code.
Admission (admission.py) runs before the prompt is tokenized: RESOURCE_EXHAUSTED when the
groups are full, UNAVAILABLE when none is up, both with `retry-after` trailing metadata
(seconds; Serve's proxy sends it for unary calls only, a failed stream's is dropped). A
structured-output spec (SamplingParams' `structured` oneof) is compiled at the ingress before
admission and any group, as over HTTP: one that cannot compile is INVALID_ARGUMENT naming the
field.
Chat and ChatStream run the chat route's own path (ChatServing, `self.chat`): the same
validation of messages and tools (grpc_chat.py maps the proto onto the route's request), tool
plan, chat template, forced-call schema and family parser, with Generate's admission and errors.
An unexpected error is INTERNAL with an id; its traceback goes to the log only.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc

from tandem.router import tandem_pb2 as pb
from tandem.router.admission import Overloaded, admitted
from tandem.router.api_key import key_matches
from tandem.router.engine_client import RequestTimeout, ServiceUnavailable, sampling_params
from tandem.router.grpc_chat import add_deltas, chat_request, tool_calls
from tandem.router.limits import RequestLimits, check_stop_counts
from tandem.router.output_constraints import SpecSource
from tandem.router.streams import ChoiceState, Deltas
from tandem.router.tracing import traced_rpc
from tandem.workers.core.request import CompletionOutput, Logprob, PositionLogprobs, SamplingParams
from tandem.workers.serving.messages import GroupDelta, GroupRequest
from tandem.workers.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

    from tandem.router.chat_tools import ChoiceCalls, ToolPlan
    from tandem.router.protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)

_NO_LOGPROB = Logprob(math.nan, 0, None)  # a chosen token missing from its position (never expected)
# Proto fields copied to the sampling dict when set (names equal SamplingParams fields).
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "logprobs", "min_tokens", "skip_special_tokens")


class RpcError(Exception):
    """A request that ends with `code`; the message is the status details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)  # both in args: Ray re-creates the exception from them
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return self.details


class GrpcMethods:
    """The Tandem service's RPCs; mixed into the ingress deployment class."""

    client: Any  # tandem.router.engine_client.EngineClient
    chat: Any  # tandem.router.chat.ChatServing (Chat, ChatStream)
    api_key: str | None
    limits: RequestLimits

    @traced_rpc("Generate")
    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
                       ) -> pb.GenerateResponse:
        try:
            self._authenticate(grpc_context)
            await self._check_structure(request)
            async with admitted(getattr(self, "admission", None), *self._grpc_sequences(request)):
                group_request = await self._prepare(request, final_only=True)
                deadline = _deadline(request)
                choices: dict[int, pb.Completion] = {}
                last: GroupDelta | None = None
                async with aclosing(self.client.stream(group_request, deadline)) as deltas:
                    async for last in deltas:
                        _raise_on_error(last)
                        for output in last.outputs:
                            choice = choices.setdefault(output.index, pb.Completion(index=output.index))
                            _merge(choice, output, group_request.sampling.logprobs)
        except Exception as exc:
            _set_status(grpc_context, exc)
            return pb.GenerateResponse()
        usage = _usage(last, sum(len(c.token_ids) for c in choices.values()))
        return pb.GenerateResponse(request_id=request.request_id or group_request.request_id,
                                   model=self.client.model_name, choices=[choices[i] for i in sorted(choices)],
                                   usage=usage)

    @traced_rpc("GenerateStream")
    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            self._authenticate(grpc_context)
            await self._check_structure(request)
            async with admitted(getattr(self, "admission", None), *self._grpc_sequences(request)):
                group_request = await self._prepare(request)
                request_id, num_top = request.request_id or group_request.request_id, group_request.sampling.logprobs
                deadline = _deadline(request)
                num_output_tokens = 0
                async with aclosing(self.client.stream(group_request, deadline)) as deltas:
                    async for delta in deltas:
                        _raise_on_error(delta)
                        message = pb.GenerateStreamResponse(request_id=request_id, model=self.client.model_name,
                                                            finished=delta.finished)
                        for output in delta.outputs:
                            _merge(message.choices.add(index=output.index), output, num_top)
                            num_output_tokens += len(output.token_ids)
                        if message.finished:
                            message.usage.CopyFrom(_usage(delta, num_output_tokens))
                        yield message
        except Exception as exc:
            raise RpcError(*_set_status(grpc_context, exc)) from None

    @traced_rpc("Chat", "chat")
    async def Chat(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext) -> pb.ChatResponse:
        try:
            self._authenticate(grpc_context)
            chat = await self._check_chat(request)
            async with admitted(getattr(self, "admission", None), *self._grpc_sequences(request)):
                plan, request_id, stream = await self._open_chat(request, chat, final_only=True)
                choices: dict[int, ChoiceState] = {}
                last: GroupDelta | None = None
                async with aclosing(stream) as deltas:
                    async for last in deltas:
                        _raise_on_error(last)
                        for output in last.outputs:
                            choices.setdefault(output.index, ChoiceState(output.index)).add(output)
            num_top = request.sampling.logprobs if request.sampling.HasField("logprobs") else None
            replies = [_chat_choice(plan, choices[i], num_top) for i in sorted(choices)]
        except Exception as exc:
            _set_status(grpc_context, exc)
            return pb.ChatResponse()
        usage = _usage(last, sum(len(c.token_ids) for c in replies))
        return pb.ChatResponse(request_id=request.request_id or request_id, model=self.client.model_name,
                               choices=replies, usage=usage)

    @traced_rpc("ChatStream", "chat")
    async def ChatStream(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext
                         ) -> AsyncIterator[pb.ChatStreamResponse]:
        try:
            self._authenticate(grpc_context)
            chat = await self._check_chat(request)
            async with admitted(getattr(self, "admission", None), *self._grpc_sequences(request)):
                plan, request_id, stream = await self._open_chat(request, chat, final_only=False)
                request_id = request.request_id or request_id
                num_top = request.sampling.logprobs if request.sampling.HasField("logprobs") else 0
                n = request.sampling.n if request.sampling.HasField("n") else 1
                # Each choice's own reader of calls, when the plan reads them.
                readers = {i: plan.choice() for i in range(n)} if plan.reads_calls else {}
                finished: set[int] = set()  # the group repeats a finished choice of n > 1 until all end
                num_output_tokens = 0
                async with aclosing(stream) as deltas:
                    async for delta in deltas:
                        _raise_on_error(delta)
                        message = pb.ChatStreamResponse(request_id=request_id, model=self.client.model_name,
                                                        finished=delta.finished)
                        for output in delta.outputs:
                            num_output_tokens += len(output.token_ids)
                            if output.index not in finished:
                                message.choices.append(_chat_delta(output, readers.get(output.index), num_top))
                            if output.finish_reason:
                                finished.add(output.index)
                        if message.finished:
                            message.usage.CopyFrom(_usage(delta, num_output_tokens))
                        yield message
        except Exception as exc:
            raise RpcError(*_set_status(grpc_context, exc)) from None

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext
                       ) -> pb.TokenizeResponse:
        try:
            self._authenticate(grpc_context)
            self._check_model(request.model)
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            token_ids = await self.client.text.tokenize(request.text, "text", add_special_tokens=add_special)
        except Exception as exc:
            _set_status(grpc_context, exc)
            return pb.TokenizeResponse()
        return pb.TokenizeResponse(token_ids=token_ids, count=len(token_ids),
                                   max_model_len=self.client.max_model_len)

    async def ModelInfo(self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext
                        ) -> pb.ModelInfoResponse:
        try:
            self._authenticate(grpc_context)
        except Exception as exc:
            _set_status(grpc_context, exc)
            return pb.ModelInfoResponse()
        vocab_size = getattr(self.client, "vocab_size", None) or len(self.client.tokenizer)
        return pb.ModelInfoResponse(model=self.client.model_name, max_model_len=self.client.max_model_len,
                                    vocab_size=vocab_size)

    async def Health(self, request: pb.HealthRequest, grpc_context: RayServegRPCContext) -> pb.HealthResponse:
        """No API key needed: load balancers probe this."""
        try:
            healthy = (await self.client.health())["ready"]  # serving while a group serves
        except Exception as exc:  # a probe answers, it does not fail
            healthy, reason = False, f"{type(exc).__name__}: {exc}"
        else:
            reason = "no replica group can serve"
        if not healthy:
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details(reason)
            return pb.HealthResponse()
        return pb.HealthResponse(status="SERVING")

    # ---- request checks ---------------------------------------------------------------------------
    def _authenticate(self, grpc_context: RayServegRPCContext) -> None:
        if not self.api_key:
            return
        metadata = dict(grpc_context.invocation_metadata())
        value = metadata.get("authorization")
        if not value:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED,
                           "authorization: missing; send metadata 'authorization: Bearer <API key>'")
        key = value[len("bearer "):] if value[:len("bearer ")].lower() == "bearer " else value
        if not key_matches(key, self.api_key):
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "authorization: invalid API key")

    def _grpc_sequences(self, request: pb.GenerateRequest | pb.ChatRequest) -> tuple[int, int]:
        """What admission charges the request (its sequences, all on one group); ValueError
        past this server's bounds, before any ticket or tokenizing (the proto's n is a uint32)."""
        sampling = request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        return self.limits.sequences(n, 1, sampling.logprobs if sampling.HasField("logprobs") else None), n

    def _check_model(self, model: str) -> None:
        if model and model != self.client.model_name:
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"model: {model!r} is not served here; this server serves {self.client.model_name!r}")

    async def _prepare(self, request: pb.GenerateRequest, final_only: bool = False) -> GroupRequest:
        """The checked group request; ValueError names the bad field."""
        self._check_model(request.model)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            token_ids = await self.client.text.tokenize(request.text, "prompt")
        elif kind == "token_ids":
            token_ids = list(request.token_ids.ids)
        else:
            raise ValueError("prompt: set either text or token_ids")
        # The id the engine knows is always the server's: a client's id is a label, echoed in
        # the responses, so two requests with the same one (or one like another's sample id,
        # "x#1") never touch each other.
        request_id = f"grpc-{uuid.uuid4().hex}"
        return self.client.request(request_id, token_ids, sampling_from_proto(request.sampling), final_only=final_only)

    async def _check_chat(self, request: pb.ChatRequest) -> ChatCompletionRequest:
        """The chat route's request for `request`, checked as the route checks its body, before
        admission: ValueError names the field."""
        spec = structured_from_proto(request.sampling)
        source = SpecSource(request.sampling.WhichOneof("structured"), spec) if spec is not None else None
        chat = chat_request(request, source, self.limits.max_json_depth)
        self._check_model(request.model)
        await self._check_structure(request)
        return chat

    async def _open_chat(self, request: pb.ChatRequest, chat: ChatCompletionRequest, *, final_only: bool
                         ) -> tuple[ToolPlan, str, Deltas]:
        """The chat's tool plan, the server's id of its group request, and that request's deltas."""
        deadline = _deadline(request)
        plan = self.chat.tools.plan(chat)
        token_ids = await self.chat.prompt_token_ids(chat, plan.template_tools)
        sampling = sampling_fields(request.sampling)
        sampling.setdefault("max_tokens", None)  # unset: up to the context length, as the chat route has it
        request_id = f"grpc-{uuid.uuid4().hex}"  # the server's own, as Generate's
        stream, _ = await self.chat.start(plan, token_ids, sampling, request_id, deadline, final_only=final_only)
        return plan, request_id, stream

    async def _check_structure(self, request: pb.GenerateRequest | pb.ChatRequest) -> None:
        """The request's spec compiled before admission and any group, as over HTTP; ValueError
        names its field."""
        spec = structured_from_proto(request.sampling)
        if spec is not None:
            await self.client.grammar.check(spec, request.sampling.WhichOneof("structured"))


def _deadline(request: pb.GenerateRequest | pb.ChatRequest) -> float | None:
    """When (time.monotonic()) the request's `timeout` runs out; ValueError for a bad one."""
    if not request.HasField("timeout"):
        return None
    if not request.timeout > 0:  # also NaN
        raise ValueError(f"timeout: must be > 0 seconds, got {request.timeout}")
    return time.monotonic() + request.timeout


def sampling_from_proto(proto: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the set fields of a proto SamplingParams; ValueError names a bad field."""
    return sampling_params(sampling_fields(proto))


def sampling_fields(proto: pb.SamplingParams) -> dict[str, Any]:
    """SamplingParams' keyword arguments from the set fields of a proto SamplingParams (the
    engine's defaults for the rest); ValueError names a bad field."""
    sampling: dict[str, Any] = {name: getattr(proto, name) for name in _OPTIONAL_SAMPLING if proto.HasField(name)}
    check_stop_counts(list(proto.stop), len(proto.stop_token_ids))
    if proto.stop:
        sampling["stop"] = list(proto.stop)
    if proto.stop_token_ids:
        sampling["stop_token_ids"] = list(proto.stop_token_ids)
    if proto.ignore_eos:
        sampling["ignore_eos"] = True
    if proto.include_stop_str_in_output:
        sampling["include_stop_str_in_output"] = True
    structured = structured_from_proto(proto)
    if structured is not None:
        sampling["structured"] = structured
    if proto.logit_bias:
        sampling["logit_bias"] = dict(proto.logit_bias)
    return sampling


def structured_from_proto(proto: pb.SamplingParams) -> StructuredSpec | None:
    """The spec the `structured` oneof sets (None: none, or json_object false); ValueError names the field."""
    kind = proto.WhichOneof("structured")
    if kind is None or (kind == "json_object" and not proto.json_object):
        return None
    try:
        if kind == "json_schema":
            return StructuredSpec("json", proto.json_schema)
        if kind == "json_object":
            return StructuredSpec("json_object")
        if kind == "choice":
            return StructuredSpec.choice(list(proto.choice.choices))
        return StructuredSpec(kind, getattr(proto, kind))
    except ValueError as exc:
        raise ValueError(f"{kind}: {str(exc).removeprefix('structured output: ')}") from None


# ---- proto building ---------------------------------------------------------------------------------
def _merge(choice: pb.Completion, output: CompletionOutput, num_top: int | None) -> None:
    """Append one sequence's delta to a Completion."""
    choice.text += output.text
    choice.token_ids.extend(output.token_ids)
    if output.logprobs:
        choice.logprobs.extend(_token_logprobs(output.token_ids, output.logprobs, num_top or 0))
    if output.finish_reason:
        choice.finish_reason = output.finish_reason
    stop_reason = output.stop_reason
    if isinstance(stop_reason, int):
        choice.stop_token_id = stop_reason
    elif isinstance(stop_reason, str):
        choice.stop_str = stop_reason


def _chat_choice(plan: ToolPlan, state: ChoiceState, num_top: int | None) -> pb.ChatChoice:
    """A whole choice, read for calls as the chat route reads it."""
    content, calls, finish_reason = plan.reply("".join(state.text), state.token_ids, state.finish_reason,
                                               state.stop_reason)
    choice = pb.ChatChoice(index=state.index, content=content, tool_calls=tool_calls(calls),
                           finish_reason=finish_reason or "", token_ids=state.token_ids)
    if num_top is not None:
        choice.logprobs.extend(_token_logprobs(state.token_ids, state.logprobs, num_top))
    return choice


def _chat_delta(output: CompletionOutput, reader: ChoiceCalls | None, num_top: int) -> pb.ChatChoiceDelta:
    """One streamed delta of a choice: read for calls by its reader, as the chat route streams it."""
    choice = pb.ChatChoiceDelta(index=output.index, token_ids=output.token_ids)
    if output.logprobs:
        choice.logprobs.extend(_token_logprobs(output.token_ids, output.logprobs, num_top))
    if reader is None:
        choice.content, finish_reason = output.text, output.finish_reason
    else:
        pieces, finish_reason = reader.step(output.text, output.token_ids, output.finish_reason, output.stop_reason)
        add_deltas(choice, pieces)
    choice.finish_reason = finish_reason or ""
    return choice


def _token_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num_top: int) -> list[pb.TokenLogprob]:
    """Each position's chosen token plus its `num_top` most likely alternatives."""
    out = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id, _NO_LOGPROB)
        top = sorted(position.items(), key=lambda item: item[1].rank)[:num_top]
        out.append(pb.TokenLogprob(
            token_id=token_id, token=chosen.decoded_token or "", logprob=chosen.logprob, rank=chosen.rank,
            top_logprobs=[pb.TopLogprob(token_id=tid, token=alt.decoded_token or "", logprob=alt.logprob)
                          for tid, alt in top]))
    return out


def _usage(last_delta: GroupDelta | None, num_output_tokens: int) -> pb.Usage:
    num_prompt = last_delta.num_prompt_tokens if last_delta is not None else 0
    cached = last_delta.num_cached_tokens if last_delta is not None else 0
    return pb.Usage(prompt_tokens=num_prompt, completion_tokens=num_output_tokens,
                    total_tokens=num_prompt + num_output_tokens, cached_tokens=cached)


def _raise_on_error(delta: GroupDelta) -> None:
    if delta.error:
        raise RpcError(grpc.StatusCode.INTERNAL, f"engine: {delta.error}")


def _set_status(grpc_context: RayServegRPCContext, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """Put the status an exception stands for on the context; unexpected ones stay INTERNAL.
    Returns (code, details)."""
    if isinstance(exc, RpcError):
        code, details = exc.code, exc.details
    elif isinstance(exc, ValueError):
        code, details = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif isinstance(exc, RequestTimeout):
        code, details = grpc.StatusCode.DEADLINE_EXCEEDED, f"timeout: {exc}"
    elif isinstance(exc, Overloaded):
        code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {exc}"
    elif isinstance(exc, ServiceUnavailable):
        code, details = grpc.StatusCode.UNAVAILABLE, str(exc) or "no replica group can serve the request"
    else:  # never the exception's text: it may carry paths; the log has the traceback under the id
        error_id = uuid.uuid4().hex[:16]
        logger.error("internal error %s in a gRPC call", error_id, exc_info=exc)
        code, details = grpc.StatusCode.INTERNAL, f"internal error (id {error_id})"
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is None and code == grpc.StatusCode.UNAVAILABLE:
        retry_after_s = 1
    if retry_after_s is not None:
        grpc_context.set_trailing_metadata([("retry-after", str(retry_after_s))])
    return code, details
