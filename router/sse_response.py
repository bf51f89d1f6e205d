"""The streamed response of the HTTP API: SSE text, each piece one body message, the last
one closing the response.

Every body message is a socket write in the ingress replica and a wake-up in HAProxy and
the client, whatever it holds. So the API's streams yield what one group delta says as one
piece, and their last piece (`LastChunk`: the last delta's chunks, the usage chunk and
`[DONE]`) closes the response in the same message, where Starlette's StreamingResponse would
send the usage, `[DONE]` and an empty closing body as three more.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from starlette.types import Send


class LastChunk(str):
    """A stream's last piece: nothing follows it."""

    __slots__ = ()


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if ended:
                continue  # (nothing comes; running the stream to its end lets its request go)
            ended = isinstance(chunk, LastChunk)
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
