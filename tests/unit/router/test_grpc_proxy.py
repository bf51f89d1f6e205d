"""The gRPC proxy's deployment calls end with their RPCs (router/grpc_proxy.py); the proxy
itself runs in tests/serve/test_grpc.py."""

from __future__ import annotations

import grpc
from ray.serve._private.proxy import gRPCProxy

from tandem.router import grpc_proxy


class FakeResponse:
    def __init__(self) -> None:
        self.num_cancels = 0

    def cancel(self) -> None:
        self.num_cancels += 1


class FakeHandle:
    deployment_name = "OpenAIIngress"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return FakeResponse()


class FakeContext:
    def __init__(self) -> None:
        self.callbacks = []
        self.status = None

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def code(self):
        return self.status

    def end(self, status) -> None:
        self.status = status
        for callback in self.callbacks:
            callback(self)


def test_a_call_is_cancelled_when_its_rpc_ends_without_an_ok_status() -> None:
    outcomes = {}
    for status in (grpc.StatusCode.OK, None, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.UNAVAILABLE):
        handle, context = FakeHandle(), FakeContext()
        wrapped = grpc_proxy.CancelledWithRpc(handle, context)
        response = wrapped.remote(b"request")
        assert handle.calls == [(b"request",)] and wrapped.deployment_name == "OpenAIIngress"
        assert response.num_cancels == 0  # not before the RPC ends
        context.end(status)
        outcomes[status] = response.num_cancels
    assert outcomes == {grpc.StatusCode.OK: 0, None: 1, grpc.StatusCode.CANCELLED: 1,
                        grpc.StatusCode.DEADLINE_EXCEEDED: 1, grpc.StatusCode.UNAVAILABLE: 1}


def test_the_proxy_method_is_wrapped_once() -> None:
    original = gRPCProxy.send_request_to_replica
    try:
        assert grpc_proxy.cancel_calls_with_their_rpcs()
        wrapped = gRPCProxy.send_request_to_replica
        assert wrapped is not original and wrapped.__wrapped__ is original
        assert grpc_proxy.cancel_calls_with_their_rpcs()
        assert gRPCProxy.send_request_to_replica is wrapped
    finally:
        gRPCProxy.send_request_to_replica = original
