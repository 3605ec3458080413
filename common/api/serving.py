"""What both OpenAI endpoints share: admission, running engine requests, timing, disconnects.

An HTTP request becomes one or more `Job`s (one per prompt; each may have n choices). `run_jobs`
merges their engine outputs into one stream of `(job, output)`; leaving it early — a client
that went away, an error — aborts every job, so their blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.api.errors import (
    APIError,
    InvalidRequestError,
    OverloadedError,
    ServerError,
    UnavailableError,
)
from common.api.internal import check_internal_token
from common.api.protocol import RESUMED_HEADER, ResumeParams
from common.api.state import ServerState
from common.api.traces import record_job, start_request_trace
from common.engine.client import EngineClient, EngineDeadError, GrammarError
from common.engine.output import RequestOutput
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams
from common.tracing import NO_TRACE, NoTrace, Trace


@dataclass(frozen=True)
class PreparedPrompt:
    """What the engine runs for one prompt: its token ids (after any chat template) and the
    request's sampling params, both validated."""

    token_ids: list[int]
    params: SamplingParams


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choice_offset: int  # choice index of this job's first sample
    kv_transfer_params: dict | None = None
    resume: Resume | None = None  # a choice another worker started
    num_cached_tokens: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    num_output_tokens: int = 0
    admission: Admission | None = None
    trace: Trace | NoTrace = NO_TRACE  # the HTTP request's, shared by its jobs
    added_ns: int = 0  # handed to the engine (time.time_ns(), as the trace's instants)
    first_token_ns: int | None = None


class Admission:
    """A job admitted but not yet handed to the engine, counted against `--max-waiting` from
    the moment it is admitted (tokenization awaits a thread pool, so many requests can pass
    admission before any reaches the engine). Released when the job reaches the engine, or
    when it is dropped without ever getting there (a client gone before its stream started)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._is_held = True
        state.num_admitted += 1

    def release(self) -> None:
        if self._is_held:
            self._is_held = False
            self._state.num_admitted -= 1

    def __del__(self) -> None:
        self.release()


def num_tokens_sent_before(job: Job) -> int:
    """The completion tokens the client has before this stream: a resumed choice's outputs so
    far, and P's first token when the proxy sent it. The stream starts after them; usage still
    counts them."""
    raw = job.kv_transfer_params or {}
    first = int(bool(raw.get("first_token_streamed")) and raw.get("first_token_id") is not None)
    return first + (job.resume.num_tokens if job.resume else 0)


def num_chars_sent_before(job: Job) -> int:
    """The characters of text the client has before this stream (a resumed choice's)."""
    return job.resume.num_sent_chars if job.resume else 0


async def resolve_resume(
    state: ServerState, request: Request, raw: ResumeParams | None, prepared: list[PreparedPrompt]
) -> Resume | None:
    """The request's `resume`, checked against its one prompt: a 400 (param "resume") for what
    the engine would refuse, before the stream's 200 is sent; internal, so the cluster token is
    needed as for kv_transfer_params."""
    if raw is None:
        return None
    check_internal_token(state, request)
    engine = state.require_ready()
    ids = raw.output_token_ids
    if len(prepared) != 1:
        raise InvalidRequestError("resume needs a single prompt", param="resume")
    prompt = prepared[0]
    resume = Resume(raw.choice_index, tuple(ids), raw.num_sent_chars)
    try:
        engine.check_resume(prompt.token_ids, prompt.params, resume)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="resume") from e
    skip = prompt.params.skip_special_tokens
    text = await state.run_blocking(engine.decoded_text, prompt.token_ids, ids, skip)
    if raw.num_sent_chars > len(text):
        raise InvalidRequestError(
            f"resume's num_sent_chars ({raw.num_sent_chars}) passes the {len(text)} characters "
            "its output tokens decode to",
            param="resume",
        )
    return resume


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param=param
        )


def admit(state: ServerState, engine: EngineClient, jobs: list[Job], request: Request) -> None:
    """Count the jobs as waiting from now on (the request no longer as arriving), or 429 if
    that passes `--max-waiting`."""
    num_waiting = engine.num_waiting + state.num_admitted
    if num_waiting + len(jobs) > state.cfg.max_waiting:
        raise OverloadedError(
            f"the server is overloaded: {num_waiting} requests are waiting "
            f"(limit {state.cfg.max_waiting}); retry later",
            headers={"Retry-After": "1"},
        )
    trace = start_request_trace(state, request)
    for job in jobs:
        job.admission = Admission(state)
        job.trace = trace
    state.arrived(request)


def new_request_id(request: Request) -> str:
    """Unique engine id; the client's X-Request-Id (echoed as is) prefixes it."""
    return f"{request.state.request_id}-{uuid.uuid4().hex[:8]}"


async def run_jobs(
    state: ServerState, engine: EngineClient, jobs: list[Job]
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Every job's outputs, as they come; the request's trace ends with the last."""
    try:
        if len(jobs) == 1:
            async with aclosing(_one(state, engine, jobs[0])) as outputs:
                async for item in outputs:
                    yield item
            return
        async with aclosing(_merged(state, engine, jobs)) as outputs:
            async for item in outputs:
                yield item
    finally:
        jobs[0].trace.end()


async def _merged(
    state: ServerState, engine: EngineClient, jobs: list[Job]
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Several jobs' outputs in one stream, as each comes."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with aclosing(_one(state, engine, job)) as outputs:
                async for item in outputs:
                    queue.put_nowait(item)
        except BaseException as e:  # noqa: BLE001 — re-raised by the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(job)  # done marker

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            item = await queue.get()
            if isinstance(item, Job):
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(
    state: ServerState, engine: EngineClient, job: Job
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    m = state.metrics
    if job.admission is not None:  # from here on the engine counts it (no await in between)
        job.admission.release()
    job.added_ns = time.time_ns()
    outputs = engine.generate(
        job.request_id, job.prompt_token_ids, job.params, job.kv_transfer_params, job.resume
    )
    async with aclosing(outputs) as gen:
        async for out in gen:
            if out.error:
                job.trace.set(error=out.error)
                fault = InvalidRequestError if out.error_is_request_fault else ServerError
                raise fault(out.error, code=out.error_code)
            now = time.perf_counter()
            new = sum(len(c.delta_token_ids) for c in out.outputs)
            if new:
                if job.last_token_at is None:
                    m.ttft.observe(now - job.arrival)
                    job.first_token_ns = time.time_ns()
                    m.first_step.observe((job.first_token_ns - job.added_ns) / 1e9)
                else:
                    m.itl.observe(now - job.last_token_at)
                job.last_token_at = now
                job.num_output_tokens += new
            job.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                m.e2e.observe(now - job.arrival)
                if job.first_token_ns is not None and job.num_output_tokens > 1:
                    decoding = (time.time_ns() - job.first_token_ns) / 1e9
                    m.tpot.observe(decoding / (job.num_output_tokens - 1))
                m.prompt_tokens.inc(len(job.prompt_token_ids))
                m.generation_tokens.inc(job.num_output_tokens)
                record_job(
                    job.trace, state.cfg.role, job.added_ns, job.first_token_ns, out.times,
                    out.kv_transfer_params,
                )  # fmt: skip
            yield job, out


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: BaseException) -> str:
    """An error event inside a stream whose 200 status has already been sent: typed, with the
    status it would have had (a 4xx: the request's fault, which the proxy never moves)."""
    if isinstance(error, ValueError):
        error = InvalidRequestError(str(error))
    elif isinstance(error, EngineDeadError):
        error = UnavailableError(str(error), code="engine_dead")
    elif not isinstance(error, APIError):
        error = ServerError(f"{type(error).__name__}: {error}")
    return sse(error.to_event().model_dump_json())


async def respond(
    request: Request,
    outputs: AsyncIterator,
    stream: AsyncGenerator[str, None] | None,
    body: Callable[[list], dict],
    resumed: bool = False,
) -> Response:
    """A generation handler's tail: `stream` (the SSE events) as a streamed response, or, when
    None, every output collected and `body(items)` as JSON; 499 when the client left first.
    `resumed`: the answer says it continues a choice (`RESUMED_HEADER`)."""
    headers = {RESUMED_HEADER: "1"} if resumed else None
    if stream is not None:
        return StreamingResponse(
            _ended(stream, outputs), media_type="text/event-stream", headers=headers
        )
    items = await collect(request, outputs)
    if items is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(body(items), headers=headers)


async def _ended(events: AsyncGenerator[str, None], outputs: AsyncIterator) -> AsyncIterator[str]:
    """A stream's ending, the same for every endpoint: an error after the 200 was sent becomes
    an error event, the outputs are closed whatever happened, and `[DONE]` comes last."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 — the status is sent: report in the stream
        yield sse_error(e)
    finally:
        await events.aclose()
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def wants_usage(req) -> bool:
    """A streamed request asked for the usage chunk at the end."""
    return bool(req.stream_options and req.stream_options.include_usage)


async def check_structured(engine: EngineClient, params: SamplingParams, param: str | None) -> None:
    """A 400 naming `param`, the request's field, for a structured output that cannot compile,
    hits a grammar limit or does not compile within its budget, and one naming `n` for more
    choices than a grammar may have; before any stream starts."""
    if params.structured is None:
        return
    try:
        engine.check_grammar_rows(params.n)
    except GrammarError as e:
        raise InvalidRequestError(str(e), param="n", code=e.code) from e
    try:
        await engine.compile_grammar(params.structured)
    except GrammarError as e:
        raise InvalidRequestError(str(e), param=param, code=e.code) from e


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request names exist (its sizes were bounded at the edge: limits.py)."""
    try:
        params.check_token_ids(vocab_size)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="stop_token_ids") from e


async def collect(request: Request, outputs: AsyncIterator) -> list | None:
    """Every item of `outputs`; None (and `outputs` closed, its requests aborted) if the client
    disconnects first."""
    items: list = []

    async def consume() -> None:
        async with aclosing(outputs) as it:
            async for item in it:
                items.append(item)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(until_disconnected(request))
    await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not consumer.done():
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        return None
    consumer.result()
    return items


def final_kv_params(items: list) -> dict | None:
    return next((out.kv_transfer_params for _, out in items if out.kv_transfer_params), None)


async def until_disconnected(request: Request, interval: float = 0.25) -> None:
    """Returns when the client has gone away (for non-streamed requests)."""
    while not await request.is_disconnected():
        await asyncio.sleep(interval)
