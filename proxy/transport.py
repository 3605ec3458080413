"""A lean HTTP/1.1 transport for the proxy's `httpx.AsyncClient`s: asyncio protocols and the
httptools parser (the one uvicorn uses), keep-alive connections to one upstream.

httpx's default transport (httpcore + h11 + anyio) costs more CPU per call than everything else
the proxy does, and more with many streams at once. This one keeps httpx's interface (requests,
responses, timeouts, exceptions) and does only what the proxy needs: plain HTTP/1.1 to a worker,
request bodies already in memory, bodies streamed back as they arrive (with back-pressure).
"""

from __future__ import annotations

import asyncio
from collections import deque

import httptools
import httpx

_MAX_BUFFERED = 1 << 20  # bytes of response body held before reading from the socket pauses


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.num_buffered = 0
        self.is_complete = False
        self.num_received = 0
        self.error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._headers_done = False
        self.keep_alive = False

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.num_received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"malformed response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if not self.is_complete:
            self._fail(httpx.RemoteProtocolError("the server closed the connection mid-response"))

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # NOTE: False once the message ends
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.num_buffered += len(body)
        if self.num_buffered > _MAX_BUFFERED and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_complete = True
        self._wake()

    # -- the request side -------------------------------------------------------------------------
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, timeout: float | None, on_timeout: type[Exception]) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        handle = None
        if timeout is not None:

            def expire() -> None:
                if not waiter.done():
                    waiter.set_exception(on_timeout(f"no data within {timeout} s"))

            handle = loop.call_later(timeout, expire)
        try:
            await waiter
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    async def send(self, head: bytes, body: bytes, read_timeout: float | None) -> None:
        self._reset()
        if self.is_closed or self.transport.is_closing():
            # NOTE: closed before connection_lost ran (uvloop raises on a write then); nothing
            # was sent, so this is a failure to connect, safe to retry anywhere
            self.is_closed = True
            raise httpx.ConnectError("the connection closed before the request was sent")
        self.transport.write(head + body)
        while not self._headers_done:
            if self.error is not None:
                raise self.error
            await self._wait(read_timeout, httpx.ReadTimeout)

    async def next_chunk(self, read_timeout: float | None) -> bytes | None:
        while not self.chunks:
            if self.is_complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait(read_timeout, httpx.ReadTimeout)
        # NOTE: everything already here at once: a stream's events often arrive in one read
        # (16 SSE chunks in 1-2), and each piece costs a relay step and a send to the client
        if len(self.chunks) == 1:
            chunk = self.chunks.popleft()
        else:
            chunk = b"".join(self.chunks)
            self.chunks.clear()
        self.num_buffered -= len(chunk)
        if self.num_buffered <= _MAX_BUFFERED // 2 and not self.is_closed:
            self.transport.resume_reading()
        return chunk

    @property
    def is_reusable(self) -> bool:
        return self.is_complete and not self.is_closed and self.keep_alive

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, transport: LeanTransport, conn: _Connection, read_timeout: float | None):
        self._transport = transport
        self._conn = conn
        self._read_timeout = read_timeout
        self._closed = False

    async def __aiter__(self):
        while (chunk := await self._conn.next_chunk(self._read_timeout)) is not None:
            yield chunk

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.give_back(self._conn)


class LeanTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 connections to one host (the worker behind one client)."""

    def __init__(self, max_idle: int = 256):
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()
        self._is_closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        head = _head(request)
        conn, reused = await self._connection(request.url, timeouts.get("connect"))
        try:
            await conn.send(head, body, timeouts.get("read"))
        except (httpx.RemoteProtocolError, httpx.ConnectError):
            conn.close()
            if not (reused and conn.num_received == 0):
                raise
            # NOTE: a kept-alive connection the server closed just as it was reused: nothing
            # reached the server's application, so one fresh connection is safe
            conn, _ = await self._connection(request.url, timeouts.get("connect"), fresh=True)
            await conn.send(head, body, timeouts.get("read"))
        except BaseException:
            conn.close()
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    async def _connection(
        self, url: httpx.URL, connect_timeout: float | None, fresh: bool = False
    ) -> tuple[_Connection, bool]:
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.is_closed:
                return conn, True
        loop = asyncio.get_running_loop()
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, url.host, port), connect_timeout
            )
        except asyncio.TimeoutError as e:
            raise httpx.ConnectTimeout(f"connect to {url.host}:{port} timed out") from e
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {url.host}:{port}: {e}") from e
        return conn, False

    def give_back(self, conn: _Connection) -> None:
        # NOTE: a response can end after its client closed (a removed worker): not kept then
        if conn.is_reusable and len(self._idle) < self.max_idle and not self._is_closed:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._is_closed = True
        while self._idle:
            self._idle.pop().close()


def _head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), target)]
    lines += [b"%s: %s" % (k, v) for k, v in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n"
