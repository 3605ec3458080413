"""One streamed request to an OpenAI-compatible server, timed as `vllm bench serve` times it.

A *token chunk* is a stream event with a choice — its text may be empty (a token whose
characters are not complete yet) — except chat's opening chunk that carries only the role.

    ttft        send → the first token chunk
    itl         the gaps between consecutive token chunks (one per chunk after the first)
    e2el        send → the end of the stream (`data: [DONE]`)
    output_len  `usage.completion_tokens` of the final usage chunk, else the token chunks
    prompt_len  `usage.prompt_tokens`, else the sample's (estimated) length
    cached_tokens  `usage.prompt_tokens_details.cached_tokens` (None if the server says nothing)
    generated_text  the streamed text, concatenated (a multi-turn chat's next history needs it)

A failed request has a reason (the keys of the `failures` count): `http_<status>`, `timeout`
(past the per-request timeout), `connection_error`, `transport_error` (the connection broke
mid-way), `stream_error` (an error event inside a 200 stream), `bad_chunk` (not JSON),
`incomplete_stream` (no `[DONE]`), `no_output` (no token chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from benchmarks.serving.datasets import SampleRequest

ENDPOINT_TYPES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    endpoint_type: str  # a key of ENDPOINT_TYPES
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 600.0  # seconds, the whole request

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_TYPES[self.endpoint_type]

    @property
    def is_chat(self) -> bool:
        return self.endpoint_type == "chat"

    def body(self, sample: SampleRequest) -> dict:
        body = {
            "model": self.model,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,  # vLLM's extension: exactly max_tokens tokens
        }
        if self.is_chat:
            body["messages"] = sample.messages or [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.expected_output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.expected_output_len
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds."""

    success: bool = False
    error_reason: str | None = None
    error: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    prompt_len: int = 0
    output_len: int = 0
    expected_output_len: int = 0
    start_time: float = 0.0  # since the benchmark started
    cached_tokens: int | None = None
    generated_text: str = ""


class RequestFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


async def send_request(
    client: httpx.AsyncClient, endpoint: Endpoint, sample: SampleRequest, t0: float
) -> RequestRecord:
    """Send `sample`, read its stream to the end, and time it (`t0`: the benchmark's start)."""
    record = RequestRecord(
        prompt_len=sample.prompt_len, expected_output_len=sample.expected_output_len
    )
    start = time.perf_counter()
    record.start_time = start - t0
    try:
        timed = _stream(client, endpoint, sample, start, record)
        await asyncio.wait_for(timed, endpoint.request_timeout)
        record.success = True
    except RequestFailed as e:
        _fail(record, e.reason, str(e))
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        _fail(record, "timeout", f"no answer within {endpoint.request_timeout}s ({e!r})")
    except httpx.ConnectError as e:
        _fail(record, "connection_error", repr(e))
    except httpx.HTTPError as e:  # the connection broke, or the body did not decode
        _fail(record, "transport_error", repr(e))
    return record


def _fail(record: RequestRecord, reason: str, message: str) -> None:
    record.success, record.error_reason, record.error = False, reason, message[:500]


async def _stream(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    sample: SampleRequest,
    start: float,
    record: RequestRecord,
) -> None:
    body, headers = endpoint.body(sample), auth_headers(endpoint.api_key)
    if sample.session_id is not None:  # the proxy keeps a conversation on the workers that hold it
        headers["X-Session-ID"] = sample.session_id
    async with client.stream("POST", endpoint.url, json=body, headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RequestFailed(f"http_{r.status_code}", text)
        last_chunk_at = None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": comments", "event:" lines
            payload = line[len("data:") :].strip()
            now = time.perf_counter()
            if payload == "[DONE]":
                record.e2el = now - start
                break
            if _read_event(_parse(payload), endpoint.is_chat, record):
                if last_chunk_at is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last_chunk_at)
                last_chunk_at = now
    if record.e2el is None:
        raise RequestFailed("incomplete_stream", "the stream ended without data: [DONE]")
    if record.ttft is None:
        raise RequestFailed("no_output", "the stream carried no output")
    if record.output_len == 0:  # no usage chunk: one token per chunk
        record.output_len = len(record.itl) + 1


def _parse(payload: str) -> dict:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError as e:
        raise RequestFailed("bad_chunk", f"{e}: {payload[:200]}") from e
    if not isinstance(event, dict):
        raise RequestFailed("bad_chunk", payload[:200])
    if "error" in event:
        raise RequestFailed("stream_error", json.dumps(event["error"]))
    return event


def _read_event(event: dict, is_chat: bool, record: RequestRecord) -> bool:
    """Record the usage an event carries; True if it is a token chunk."""
    usage = event.get("usage")
    if usage:
        record.output_len = usage.get("completion_tokens") or record.output_len
        record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if not is_chat:
        record.generated_text += choice.get("text") or ""
        return True
    delta = choice.get("delta") or {}
    record.generated_text += delta.get("content") or ""
    if choice.get("finish_reason") is not None:
        return True
    return not (delta.get("role") and not delta.get("content"))  # not the role-only opener


class ModelLookupError(RuntimeError):
    """No model id could be read from the server (and none was given)."""


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first id of GET /v1/models (what `--model` defaults to)."""
    try:
        r = await client.get(f"{base_url}/v1/models", headers=auth_headers(api_key))
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ModelLookupError(
            f"could not read a model id from {base_url}/v1/models ({e!r}); pass --model"
        ) from e


class Target(Protocol):
    """What a run's client needs of its config (config.py's BenchConfig, which imports this
    module: the client names only these fields, so the two need not import each other)."""

    model: str | None
    api_key: str | None
    ignore_eos: bool
    temperature: float
    request_timeout: float

    @property
    def root_url(self) -> str: ...


@contextlib.asynccontextmanager
async def connected(
    cfg: Target, endpoint_type: str, num_connections: int | None
) -> AsyncIterator[tuple[httpx.AsyncClient, Endpoint]]:
    """A client of `num_connections` (None: no limit) and the endpoint a run sends to, its
    model asked of the server when `cfg` names none."""
    num = num_connections
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=num)
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(10.0, cfg.request_timeout))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = cfg.model or await first_model(client, cfg.root_url, cfg.api_key)
        yield client, Endpoint(
            cfg.root_url, endpoint_type, model, cfg.api_key, cfg.ignore_eos, cfg.temperature,
            cfg.request_timeout,
        )  # fmt: skip
