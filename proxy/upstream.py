"""Calls from the proxy to one worker, each with its own timeout, and how they fail.

Every failure is an `UpstreamError`: `status`/`body` when the worker answered with an error
(passed to the client as is when it is the client's fault), `is_connect` when the worker was
never reached (nothing was sent, so any retry is safe and the worker is ejected).
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx

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
        """The request itself is wrong: another worker would refuse it too."""
        return self.status is not None and 400 <= self.status < 500 and self.status not in (
            408,
            429,
        )

    @property
    def kind(self) -> str:
        if self.is_connect:
            return "connect"
        return "timeout" if self.status is None and "timed out" in self.message else (
            f"http_{self.status}" if self.status else "transport"
        )


def make_client(url: str, connect_timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(30.0, connect=connect_timeout),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
    )


@contextmanager
def _failures(worker: Worker, what: str):
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise UpstreamError(worker, f"{what}: cannot connect ({e!r})", is_connect=True) from e
    except httpx.TimeoutException as e:
        raise UpstreamError(worker, f"{what}: timed out ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise UpstreamError(worker, f"{what}: {e!r}") from e


async def post_json(
    worker: Worker, path: str, payload: dict, headers: dict, timeout: float
) -> dict:
    """POST a JSON body, return the JSON answer; an error status is an `UpstreamError`."""
    what = f"{worker.role} worker {worker.url}{path}"
    with _failures(worker, what):
        r = await worker.client.post(
            path, content=_dumps(payload), headers={**JSON_HEADERS, **headers}, timeout=timeout
        )
    if r.status_code != 200:
        raise UpstreamError(worker, f"{what} answered {r.status_code}", r.status_code, r.content)
    try:
        return r.json()
    except ValueError as e:
        raise UpstreamError(worker, f"{what} answered with invalid JSON") from e


async def open_stream(
    worker: Worker, path: str, content: bytes, headers: dict, timeout: httpx.Timeout
) -> httpx.Response:
    """Send a request and return the response once its headers arrived (the body streams); an
    error status is read whole and raised as an `UpstreamError`."""
    what = f"{worker.role} worker {worker.url}{path}"
    request = worker.client.build_request(
        "POST", path, content=content, headers={**JSON_HEADERS, **headers}, timeout=timeout
    )
    with _failures(worker, what):
        r = await worker.client.send(request, stream=True)
        if r.status_code != 200:
            try:
                body = await r.aread()
            finally:
                await r.aclose()
            raise UpstreamError(worker, f"{what} answered {r.status_code}", r.status_code, body)
    return r


def error_message(body: bytes | None) -> str | None:
    """The message of an OpenAI-shaped error body, if it is one."""
    try:
        return json.loads(body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        return None


def _dumps(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
