"""The HTTP protocol the workers and the proxy serve with: uvicorn's httptools protocol with the
request head (request line and headers) bounded.

httptools keeps a header of any size: 8 MB in one `X-...` header is read into memory and handed
to the app. `bounded_http(max_header_bytes)` is a protocol class for `uvicorn.Config(http=...)`
that counts the bytes a connection sends while a request's head is incomplete and, past the
limit, answers 431 in OpenAI's error shape and closes the connection: a head holds at most the
limit and one read of the socket in memory.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.api.limits import LIMIT_CODE


def bounded_http(max_header_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, refusing a request head above `max_header_bytes`."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._in_head = True
            self._head_bytes = 0
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)  # NOTE: its callbacks below say where the head ends
            if not self._in_head or self.transport.is_closing():
                return
            self._head_bytes += len(data)
            if self._head_bytes > max_header_bytes:
                self._refuse_head()

        def on_message_begin(self) -> None:
            self._in_head = True
            self._head_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _refuse_head(self) -> None:
            message = (
                f"the request line and headers exceed {max_header_bytes} bytes "
                "(--max-header-bytes)"
            )
            error = {"message": message, "type": "invalid_request_error", "param": None,
                     "code": LIMIT_CODE}  # fmt: skip
            body = json.dumps({"error": error}).encode()
            head = (
                "HTTP/1.1 431 Request Header Fields Too Large\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.close()

    return BoundedHttpToolsProtocol
