"""What tandem runs inside Serve's gRPC proxy: the servicer function that `grpc_options`
names (Serve imports and calls it in the proxy actor), and a fix to the proxy's handling of
a client's cancel.

Serve's proxy (Ray 2.60, `gRPCProxy.send_request_to_replica`) cancels the deployment call of
a server-streaming RPC only when the client's cancel finds it awaiting the call's next
message. When the cancel finds it handing a message to gRPC, gRPC closes the proxy's
generator at that `yield`, nothing cancels the call, and the request runs on to its last
token, holding a seat in its group and its KV blocks. A stream that sends messages quickly
spends most of its time there. So each deployment call the proxy makes for an RPC is
cancelled when that RPC ends without an OK status (the client's cancel, its deadline),
whatever the proxy was doing at the time.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import grpc

from tandem.router import tandem_pb2_grpc

logger = logging.getLogger(__name__)


def add_TandemServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - the name gRPC's codegen gives
    cancel_calls_with_their_rpcs()
    tandem_pb2_grpc.add_TandemServicer_to_server(servicer, server)


class CancelledWithRpc:
    """A deployment handle whose calls are cancelled when the RPC of `context` (a gRPC
    servicer context) ends without an OK status. An RPC closed at that `yield` ends with no
    status set, and `context.cancelled()` says False; a call that has already finished (an
    error status) ignores the cancel."""

    def __init__(self, handle: Any, context: Any) -> None:
        self._handle = handle
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        response = self._handle.remote(*args, **kwargs)

        def on_rpc_done(context: Any) -> None:
            if context.code() != grpc.StatusCode.OK:
                response.cancel()

        self._context.add_done_callback(on_rpc_done)
        return response


def cancel_calls_with_their_rpcs() -> bool:
    """Make the gRPC proxy's deployment calls end with their RPCs (idempotent). False where
    this Ray has no such proxy method to wrap: the proxy then runs as Ray ships it."""
    try:
        from ray.serve._private.proxy import gRPCProxy
    except ImportError:
        return False
    send = getattr(gRPCProxy, "send_request_to_replica", None)
    if send is None:
        logger.warning("this Ray's gRPC proxy has no send_request_to_replica: a cancelled stream may run on")
        return False
    if getattr(send, "cancels_with_rpc", False):
        return True

    @functools.wraps(send)
    async def send_request_to_replica(self: Any, request_id: str, internal_request_id: str, handle: Any,
                                      proxy_request: Any, *args: Any, **kwargs: Any):
        context = getattr(proxy_request, "context", None)
        if context is not None and hasattr(context, "add_done_callback"):
            handle = CancelledWithRpc(handle, context)
        async for message in send(self, request_id, internal_request_id, handle, proxy_request, *args, **kwargs):
            yield message

    send_request_to_replica.cancels_with_rpc = True
    gRPCProxy.send_request_to_replica = send_request_to_replica
    return True
