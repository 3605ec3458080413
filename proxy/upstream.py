"""Calls from the proxy to one worker, each with its own timeout, and how they fail.

Every failure is an `UpstreamError`: `status`/`body` when the worker answered with an error
(a 4xx of the request's fault: passed to the client as the worker wrote it, never retried),
`is_connect` when the worker was never reached (nothing was sent, so any retry is safe and the
worker is ejected); `WorkerEjected` when health checks ejected the worker while the call waited
on it. `fault` says whose it is, for the proxy's counts.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
from httpx import AsyncBaseTransport

from common.api.errors import Fault, is_request_fault
from proxy.transport import LeanTransport
from proxy.workers import Worker

JSON_HEADERS = {"content-type": "application/json"}


class UpstreamError(Exception):
    def __init__(
        self,
        worker: Worker,
        message: str,
        status: int | None = None,
        body: bytes | None = None,
        is_connect: bool = False,
    ):
        super().__init__(message)
        self.worker = worker
        self.message = message
        self.status = status
        self.body = body
        self.is_connect = is_connect

    @property
    def is_client_error(self) -> bool:
        """A 4xx of the request's own fault, passed on and never retried on another worker
        (which would refuse it too, or be asked to do the same work again). A 401 or 403 (the
        proxy's --internal-token does not match the worker's), 408 or 429 (the worker is busy)
        speak of the worker: retried, or served by D alone, as any worker fault."""
        return self.status is not None and is_request_fault(self.status)

    @property
    def fault(self) -> Fault:
        return "request" if self.is_client_error else "worker"

    @property
    def kind(self) -> str:
        if self.is_connect:
            return "connect"
        return (
            "timeout"
            if self.status is None and "timed out" in self.message
            else (f"http_{self.status}" if self.status else "transport")
        )


class WorkerEjected(UpstreamError):
    """The health checks ejected the worker while this call waited on it, or it was drained
    with migration (`reason` "drain"; proxy/inflight.py)."""

    reason: str = "ejected"

    @property
    def kind(self) -> str:
        return "ejected"


def make_client(
    url: str, connect_timeout: float, lean: bool = True
) -> tuple[httpx.AsyncClient, AsyncBaseTransport]:
    """One client per worker, keep-alive, explicit timeouts. Plain HTTP goes through the lean
    transport unless `lean` is off (`--http-client httpx`; TLS always through httpx's own);
    the hot path calls the transport directly, skipping the client's auth / redirect / cookie
    layers it does not use."""
    if lean and url.startswith("http://"):
        transport: AsyncBaseTransport = LeanTransport()
    else:
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        )
    client = httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(30.0, connect=connect_timeout), transport=transport
    )
    return client, transport


@contextmanager
def _failures(worker: Worker, path: str):
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        what = _what(worker, path)
        raise UpstreamError(worker, f"{what}: cannot connect ({e!r})", is_connect=True) from e
    except httpx.TimeoutException as e:
        what = _what(worker, path)
        raise UpstreamError(worker, f"{what}: timed out ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise UpstreamError(worker, f"{_what(worker, path)}: {e!r}") from e


def _what(worker: Worker, path: str) -> str:
    return f"{worker.role} worker {worker.url}{path}"


async def _send(
    worker: Worker, path: str, content: bytes, headers: dict, timeout: httpx.Timeout
) -> httpx.Response:
    request = httpx.Request(
        "POST",
        worker.endpoint(path),
        content=content,
        headers={**JSON_HEADERS, **headers},
        extensions={"timeout": timeout.as_dict()},
    )
    with _failures(worker, path):
        r = await worker.transport.handle_async_request(request)
        if r.status_code != 200:
            try:
                body = await r.aread()
            finally:
                await r.aclose()
            raise UpstreamError(
                worker, f"{_what(worker, path)} answered {r.status_code}", r.status_code, body
            )
    return r


async def post_json(
    worker: Worker, path: str, payload: dict, headers: dict, timeout: httpx.Timeout
) -> dict:
    """POST a JSON body, return the JSON answer; an error status is an `UpstreamError`."""
    r = await _send(worker, path, _dumps(payload), headers, timeout)
    with _failures(worker, path):
        try:
            body = await r.aread()
        finally:
            await r.aclose()
    try:
        return json.loads(body)
    except ValueError as e:
        raise UpstreamError(worker, f"{_what(worker, path)} answered with invalid JSON") from e


async def open_stream(
    worker: Worker, path: str, content: bytes, headers: dict, timeout: httpx.Timeout
) -> httpx.Response:
    """Send a request and return the response once its headers arrived (the body streams); an
    error status is read whole and raised as an `UpstreamError`."""
    return await _send(worker, path, content, headers, timeout)


def error_object(body: bytes | None) -> dict | None:
    """The "error" of an OpenAI-shaped error body, if it is one."""
    try:
        error = json.loads(body)["error"]
    except (TypeError, ValueError, KeyError):
        return None
    return error if isinstance(error, dict) and isinstance(error.get("message"), str) else None


def error_message(body: bytes | None) -> str | None:
    """The message of an OpenAI-shaped error body, if it is one."""
    error = error_object(body)
    return None if error is None else error["message"]


def _dumps(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
