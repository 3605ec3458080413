"""The call to D: the client's body plus P's `kv_transfer_params` (or the body alone, D computing
the prompt), D's response once its headers arrived.

- **A D never reached.** A D that cannot be reached, or refuses with a 503 before any byte (it
  drains or stops), is replaced by another unless the KV was pushed into it (`open`).
- **A whole answer** (`whole`, not streamed): a D that fails before answering (a reset, a
  timeout, a 5xx, an ejection, a drain with migration) is replaced: the request runs again from
  its prompt (no tokens reached the client), planned and prefilled as a new request, the D's
  that failed it left out, up to `--migration-limit` times. A stream's D is read by relay.py.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from common.api.errors import APIError, UnavailableError
from proxy.inflight import InFlight
from proxy.journey.calls import WorkerCalls, upstream_error_response
from proxy.journey.plan import Plan, Planner
from proxy.journey.prefill import Prefilled, Prefills
from proxy.metrics import ProxyMetrics
from proxy.request import ProxyRequest
from proxy.upstream import UpstreamError, WorkerEjected, open_stream
from proxy.workers import FailedWorkers, Worker

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Upstream:
    """One decode stream the client's stream reads from."""

    resp: httpx.Response
    worker: Worker
    choices: tuple[int, ...]  # the client's choices it carries
    prefilled: Prefilled | None = None
    task: asyncio.Task | None = None
    cut_reason: str | None = None  # set when the proxy cut it (ejection, drain)
    is_done: bool = False  # D sent [DONE]: it ended well, whatever its choices said
    unwatch: object = None


class Decodes:
    def __init__(
        self,
        planner: Planner,
        prefills: Prefills,
        calls: WorkerCalls,
        inflight: InFlight,
        metrics: ProxyMetrics,
    ):
        self.cfg = planner.cfg
        self.planner = planner
        self.prefills = prefills
        self.calls = calls
        self.inflight = inflight
        self.metrics = metrics

    def content(self, req: ProxyRequest, prefilled: Prefilled | None, first_sent: bool) -> bytes:
        """D's body: the client's, P's params added (`first_sent`: P's token is the client's)."""
        track = self.cfg.migration_limit > 0 and req.is_stream  # the ids a migration carries
        if prefilled is None:
            return req.decode_body(None, track)
        params = dict(prefilled.params)
        if first_sent:
            params["first_token_streamed"] = True
        elif req.wants_logprobs:  # P's token has no logprobs: D recomputes the last prompt token
            params.pop("first_token_id", None)
        return req.decode_body(params, track)

    async def open_once(
        self,
        req: ProxyRequest,
        decode: Worker,
        content: bytes,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """D's response, headers received, counted in D's outstanding requests (the caller
        lowers the count once done with it)."""
        decode.num_outstanding += 1
        # NOTE: open until D's answer ends, which is the request's end (the trace ends it)
        span = req.trace.child("proxy.decode", "client", **{"server.address": decode.url})
        req.trace.set(**{"pdserve.decode_url": decode.url})
        try:
            headers = self.calls.headers(req, span)
            return await open_stream(
                decode, req.path, content, headers, timeout or self.calls.stream_timeout
            )
        except BaseException as e:  # the client leaving (cancelled) included
            why = e.kind if isinstance(e, UpstreamError) else type(e).__name__
            req.trace.end_span(span, error=why)
            decode.num_outstanding -= 1
            raise

    async def open(
        self,
        req: ProxyRequest,
        decode: Worker,
        prefilled: Prefilled | None,
        first_sent: bool = False,
        content: bytes | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> tuple[httpx.Response, Worker]:
        """D's response and the D; another D when one cannot be reached (unless the KV was
        pushed into that one)."""
        if content is None:
            content = self.content(req, prefilled, first_sent)
        can_switch = prefilled is None or prefilled.push_to is None
        tried: tuple[Worker, ...] = ()
        while True:
            tried += (decode,)
            try:
                return await self.open_once(req, decode, content, timeout), decode
            except UpstreamError as e:
                self.calls.failed(e)
                others = self.planner.pools["decode"].routable(exclude=tried)
                # NOTE: a 503 before any byte: a D that drains (or stops) takes nothing new
                refused = e.is_connect or e.status == 503
                retry = refused and can_switch and len(tried) <= self.cfg.max_retries
                if not (retry and others):
                    raise
                self.metrics.retries.labels("decode").inc()
                decode = self.planner.choose("decode", req, tried)

    async def whole(
        self, req: ProxyRequest, decode: Worker, prefilled: Prefilled | None
    ) -> Response:
        """D's whole answer. A D that fails before answering is replaced: the request runs again
        from its prompt, planned as a new request, up to `--migration-limit` times."""
        content = self.content(req, prefilled, first_sent=False)
        failed = FailedWorkers()
        while True:
            limit_left = failed.num_failures < self.cfg.migration_limit
            exclude = (*failed.excluded, decode)

            def movable(limit_left=limit_left, exclude=exclude) -> bool:
                return limit_left and bool(self.planner.pools["decode"].routable(exclude))

            try:
                return await self.inflight.call(
                    decode, self._answer_whole(req, decode, prefilled, content), movable
                )
            except UpstreamError as e:
                self.prefills.give_back(prefilled)
                if isinstance(e, WorkerEjected):
                    self.calls.failed(e)
                failed.add(e.worker)
                reason = migration_reason(e)
                refusal = self._whole_refusal(e, failed.num_failures)
                if refusal is None:
                    try:
                        plan = await self.planner.plan(req, failed.excluded, wait=True)
                    except UnavailableError:
                        refusal = "no_decode"
                if refusal is not None:
                    if reason is not None:
                        self.metrics.migrations_refused.labels(refusal).inc()
                    return upstream_error_response(e)
                self.metrics.migrations.labels(reason).inc()
                self.metrics.migration_recomputed.inc(req.estimated_tokens())
                decode, prefilled = plan.decode, await self._prefill_again(req, plan)
                logger.warning(
                    "request %s runs again on %s (%s)", req.request_id, decode.url, reason
                )
                content = self.content(req, prefilled, first_sent=False)

    async def _prefill_again(self, req: ProxyRequest, plan: Plan) -> Prefilled | None:
        """A rerun's prompt on P, by its plan (as a new request's); None: D computes it."""
        if not plan.is_disaggregated:
            return None
        try:
            return await self.prefills.prefill(req, plan)
        except APIError as e:  # P refused it now: D computes it, and answers for it
            logger.warning("prefill for a request run again failed: %s", e)
            return None

    def _whole_refusal(self, e: UpstreamError, num_failed: int) -> str | None:
        """Why a non-streamed request whose D failed does not run again elsewhere, or None."""
        if migration_reason(e) is None:
            return "not_a_failure"  # the request's own fault, or a worker never reached
        if num_failed > self.cfg.migration_limit:
            return "limit"
        return None

    async def _answer_whole(
        self, req: ProxyRequest, decode: Worker, prefilled: Prefilled | None, content: bytes
    ) -> Response:
        # NOTE: D answers only once it has generated everything: the whole wait is a read
        resp, decode = await self.open(
            req, decode, prefilled, content=content, timeout=self.calls.whole_timeout
        )
        try:
            body = await resp.aread()
        except httpx.HTTPError as e:
            raise UpstreamError(decode, f"decode failed: {e!r}") from e
        finally:
            decode.num_outstanding -= 1
            await resp.aclose()
        return Response(body, media_type="application/json")


def migration_reason(e: UpstreamError) -> str | None:
    """Why a D failed a request that another D can take: None for the request's own fault
    (a 4xx) and for a D never reached (already retried on another, `Decodes.open`)."""
    if isinstance(e, WorkerEjected):
        return "drain" if e.reason == "drain" else "ejected"
    if e.is_client_error or e.is_connect or e.status in (401, 403):
        return None
    if e.kind == "timeout":
        return "timeout"
    return "error_event" if e.status is not None else "connection"
