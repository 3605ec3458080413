"""One request through the workers: plan the path, prefill on P, decode on D, stream back.

- **Route.** Where workers publish KV events, P and D are chosen by the blocks they hold, the
  prompt's token ids rendered first (proxy/kv_routing.py); elsewhere by the pools' policies.
- **Plan.** Disaggregated (P then D) unless the mode is colocated, the prompt is short
  (`min_disagg_tokens`, estimated), it is a batch of prompts, no P is routable, or D already
  holds all of the prompt but a few tokens (`cached_on_decode_tokens`): then D alone.
- **Prefill.** P computes the prompt and one token and keeps the KV (pull) or writes it into
  blocks D reserved first (push). When D holds a longer prefix of the prompt than P (an
  earlier turn's answer), D leases those blocks first and P reads them instead of computing
  them (the reverse pull, `--reverse-pull-min-tokens`; in push mode D's reservation starts with
  the blocks it holds, and P writes only the rest). A P that fails is ejected
  (connect errors) and the next one is tried; when none is left the request goes to D alone.
  A P that the health checks eject while a prefill waits on it (frozen) fails that prefill at
  once, retried the same way (inflight.py).
- **Decode.** D gets the client's body plus P's `kv_transfer_params`. Streamed, P's first token
  goes to the client at once and D continues after it. A D that cannot be reached before any of
  its bytes were sent is replaced by another (pull mode); a D that fails mid-stream hands each
  unfinished choice to another D, which continues where the client's stream stopped
  (proxy/migration.py); a non-streamed request whose D fails runs again on another D, up to
  `--migration-limit` times. Whatever P still holds for a request that will not read it is
  released (leases expire anyway).
- **Whose fault.** A worker's 4xx, before a stream or as an error event in one, is the
  request's own fault (but a 401, 403, 408 or 429, which speak of the worker): returned (or
  passed on in the stream) as the worker wrote it, never retried on another worker nor moved;
  only the worker's faults (a 5xx, a reset, a timeout, an ejection, and those four) are retried
  or moved. `pdserve_proxy_upstream_faults_total{role, fault}` counts
  each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import httpx
from fastapi.responses import Response

from common.api.errors import APIError, ServerError, UnavailableError
from proxy.config import ProxyConfig
from proxy.inflight import InFlight
from proxy.kv_events import KVEventFeeds
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.migration import ClientStream, MigratingRelay, Upstream
from proxy.policies import create_policy
from proxy.request import ProxyRequest
from proxy.sessions import SessionAffinity
from proxy.sse import EventStreamResponse, error_event, first_token_events, passed_on_event
from proxy.upstream import (
    UpstreamError,
    WorkerEjected,
    error_message,
    error_object,
    open_stream,
    post_json,
)
from proxy.workers import FailedWorkers, Worker, WorkerPool

logger = logging.getLogger(__name__)


@dataclass
class Prefilled:
    worker: Worker  # the P that holds (pull) or wrote (push) the prompt's KV
    answer: dict  # P's response: the first token
    params: dict  # P's kv_transfer_params, for D
    push_to: dict | None = None  # push: the reservation on D
    reserved_on: Worker | None = None  # push: the D that holds the reservation

    @property
    def has_first_token(self) -> bool:
        return self.params.get("first_token_id") is not None


@dataclass
class Lent:
    """The reverse pull: a prompt prefix D holds under a lease for P to read."""

    params: dict  # D's kv_transfer_params for P (prefix_only)
    num_tokens: int  # the tokens its blocks hold


class Orchestrator:
    def __init__(
        self,
        cfg: ProxyConfig,
        pools: dict[str, WorkerPool],
        metrics: ProxyMetrics,
        kv_events: KVEventFeeds,
    ):
        self.cfg = cfg
        self.pools = pools
        self.metrics = metrics
        self.policies = {
            "prefill": create_policy(cfg.prefill_policy),
            "decode": create_policy(cfg.decode_policy),
        }
        self.internal = {"X-Internal-Token": cfg.internal_token} if cfg.internal_token else {}
        self.stream_timeout = httpx.Timeout(cfg.decode_timeout, connect=cfg.connect_timeout)
        self._prefill_timeout = httpx.Timeout(cfg.prefill_timeout, connect=cfg.connect_timeout)
        self._internal_timeout = httpx.Timeout(5.0, connect=cfg.connect_timeout)
        self._whole_timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        self._background: set[asyncio.Task] = set()
        self.inflight = InFlight()  # prefills, cut short when health checks eject their P
        self.kv = KVRouter(cfg, pools, kv_events, metrics)
        self.sessions = {r: SessionAffinity(r, metrics, cfg.max_sessions) for r in self.policies}

    async def handle(self, req: ProxyRequest) -> Response:
        start = time.perf_counter()
        routing = req.trace.child("proxy.route")
        token_ids = await self.kv.prompt_tokens(req)  # None: no worker's KV events to route by
        decode = self.choose("decode", req, token_ids=token_ids)
        path, reason = self._plan(req, decode, token_ids)
        req.trace.end_span(routing, **{"pdserve.path": path, "pdserve.reason": reason})
        prefilled = None
        if path == "disaggregated":
            prefilled = await self.prefill(req, decode, token_ids)
            if prefilled is None:
                path, reason = "colocated", "prefill_failed"
        req.trace.set(**{"pdserve.path": path, "pdserve.reason": reason})
        self.metrics.routed.labels(path, reason).inc()
        if not req.is_stream:
            return await self._decode_whole(req, decode, prefilled)
        client = ClientStream(req)
        if (
            prefilled is not None
            and prefilled.has_first_token
            and self.cfg.first_token_from_prefill
            and req.can_stream_first_token
        ):
            return _sse(self._stream_after_first(req, decode, prefilled, start, client))
        try:
            resp, decode = await self._open_decode(req, decode, prefilled, first_sent=False)
        except UpstreamError as e:
            self.give_back(prefilled)
            return upstream_error_response(e)
        first = Upstream(resp, decode, tuple(client.choices), prefilled)
        return _sse(self._relay(req, first, client, start))

    # -- plan and prefill ------------------------------------------------------------------------
    def _plan(
        self, req: ProxyRequest, decode: Worker, token_ids: list[int] | None
    ) -> tuple[str, str]:
        if self.cfg.mode == "colocated":
            return "colocated", "mode"
        if req.is_batch:
            return "colocated", "batch"
        if not self.pools["prefill"].routable():
            return "colocated", "no_prefill"
        if self.cfg.min_disagg_tokens and req.estimated_tokens() < self.cfg.min_disagg_tokens:
            return "colocated", "short_prompt"
        if token_ids is not None and self.kv.is_cached_on(decode, token_ids):
            return "colocated", "cached_on_decode"
        return "disaggregated", self.cfg.mode

    async def choose_soon(
        self, role: str, req: ProxyRequest, exclude: tuple[Worker, ...] = ()
    ) -> Worker:
        """A worker for a request that moves (its D failed): when none is routable, one may be
        about to come back (the last of a rolling restart), so wait the time the health checks
        take to readmit one before UnavailableError."""
        health = self.cfg.health
        wait_until = time.monotonic() + health.interval * (health.success_threshold + 1)
        while True:
            try:
                return self.choose(role, req, exclude)
            except UnavailableError:
                if time.monotonic() >= wait_until:
                    raise
                await asyncio.sleep(0.1)

    def choose(
        self,
        role: str,
        req: ProxyRequest,
        tried: tuple[Worker, ...] = (),
        token_ids: list[int] | None = None,
    ) -> Worker:
        workers = self.pools[role].routable(exclude=tried)
        if not workers:
            raise UnavailableError(f"no healthy {role} worker", headers={"Retry-After": "1"})
        key = req.prompt_text[: self.cfg.prefix_chars]

        def by_prompt() -> Worker:
            if token_ids is not None:
                return self.kv.choose(role, workers, token_ids, self.policies[role], key)
            return self.policies[role].choose(workers, key)

        if req.session_id is not None and self.cfg.session_affinity:
            return self.sessions[role].choose(req.session_id, workers, by_prompt)
        return by_prompt()

    async def prefill(
        self,
        req: ProxyRequest,
        decode: Worker | None,
        token_ids: list[int] | None,
        push: bool = True,
    ) -> Prefilled | None:
        """P's answer and where the KV is, or None when no P could give it (D computes it).
        `push` False (or no `decode`): D pulls it, whatever the mode."""
        tried: tuple[Worker, ...] = ()
        for attempt in range(1 + self.cfg.max_retries):
            if not self.pools["prefill"].routable(exclude=tried):
                return None
            worker = self.choose("prefill", req, tried, token_ids)
            tried += (worker,)
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            pushing = push and decode is not None and self.cfg.mode == "push"
            push_to, lent = await self._reserve_and_borrow(req, worker, decode, token_ids, pushing)
            started = time.perf_counter()
            span = req.trace.child("proxy.prefill", "client", **{"server.address": worker.url})
            try:
                worker.num_outstanding += 1
                headers = {"X-Request-Id": req.request_id, **self.internal}
                headers.update(req.trace.headers(span))
                body = req.prefill_body(push_to, lent and lent.params)
                with self.kv.prefilling(worker, token_ids):
                    answer = await self.inflight.call(
                        worker, post_json(worker, req.path, body, headers, self._prefill_timeout)
                    )
            except UpstreamError as e:
                req.trace.end_span(span, error=e.kind)
                self.failed(e)
                if push_to is not None:
                    self._release(decode, {"reservation_id": push_to["reservation_id"]})
                if e.is_client_error:
                    raise UpstreamAPIError(e) from e
                continue
            finally:
                worker.num_outstanding -= 1
                req.trace.end_span(span)
                if lent is not None:  # read (P let it go already) or not: D's lease ends
                    self._release(decode, {"request_id": lent.params["remote_request_id"]})
            req.trace.set(**{"pdserve.prefill_url": worker.url})
            self.metrics.prefill.observe(time.perf_counter() - started)
            self.metrics.count_prefill_usage(answer, lent.num_tokens if lent else 0)
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict):
                logger.warning("prefill worker %s returned no kv_transfer_params", worker.url)
                return None
            return Prefilled(worker, answer, params, push_to, decode if push_to else None)
        return None

    async def _reserve_and_borrow(
        self,
        req: ProxyRequest,
        prefill: Worker,
        decode: Worker | None,
        token_ids: list[int] | None,
        pushing: bool,
    ) -> tuple[dict | None, Lent | None]:
        """What D does before P starts, both asked at once: the push reservation (`pushing`)
        and the prefix it lends (the reverse pull); a lease is given back if the reservation
        fails."""
        lending = asyncio.ensure_future(self._borrow_prefix(req, prefill, decode, token_ids))
        try:
            push_to = await self._reserve(req, decode) if pushing else None
        except BaseException:
            if (lent := await lending) is not None:
                self._release(decode, {"request_id": lent.params["remote_request_id"]})
            raise
        return push_to, await lending

    async def _borrow_prefix(
        self,
        req: ProxyRequest,
        prefill: Worker,
        decode: Worker | None,
        token_ids: list[int] | None,
    ) -> Lent | None:
        """The reverse pull: the prompt prefix D holds beyond P's, leased on D for P to read,
        when that saves `reverse_pull_min_tokens`; else None."""
        limit = self.cfg.reverse_pull_min_tokens
        if not limit or decode is None or token_ids is None:
            return None
        if self.kv.reverse_gain(prefill, decode, token_ids) < limit:
            return None
        span = req.trace.child("proxy.lease_prefix", "client", **{"server.address": decode.url})
        try:
            answer = await post_json(
                decode,
                "/internal/kv/lease",
                {"token_ids": token_ids},
                self.internal,
                self._internal_timeout,
            )
        except UpstreamError as e:  # P computes the prefix: nothing is lost
            logger.info("no prefix lent by %s: %s", decode.url, e.message)
            self.metrics.reverse_pulls.labels("failed").inc()
            req.trace.end_span(span, error=e.kind)
            return None
        req.trace.end_span(span)
        lent = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(lent, dict):
            self.metrics.reverse_pulls.labels("nothing_cached").inc()
            return None
        self.metrics.reverse_pulls.labels("lent").inc()
        num_tokens = answer.get("num_tokens")
        return Lent(lent, num_tokens if isinstance(num_tokens, int) else 0)

    async def _reserve(self, req: ProxyRequest, decode: Worker) -> dict | None:
        """Push: blocks on D for the prompt; None (pull instead) when D cannot spare them."""
        span = req.trace.child("proxy.reserve", "client", **{"server.address": decode.url})
        try:
            return await post_json(
                decode, "/internal/kv/reserve", req.reserve_body(), self.internal,
                self._internal_timeout,
            )  # fmt: skip
        except UpstreamError as e:
            req.trace.end_span(span, error=e.kind)
            if e.is_client_error:
                raise UpstreamAPIError(e) from e
            logger.warning("reservation failed, pulling instead: %s", e.message)
            return None
        finally:
            req.trace.end_span(span)

    # -- decode ----------------------------------------------------------------------------------
    def _decode_content(self, req: ProxyRequest, prefilled: Prefilled | None, first_sent: bool):
        track = self.cfg.migration_limit > 0 and req.is_stream  # the ids a migration carries
        if prefilled is None:
            return req.decode_body(None, track)
        params = dict(prefilled.params)
        if first_sent:
            params["first_token_streamed"] = True
        elif req.wants_logprobs:  # P's token has no logprobs: D recomputes the last prompt token
            params.pop("first_token_id", None)
        return req.decode_body(params, track)

    async def _decode_whole(
        self, req: ProxyRequest, decode: Worker, prefilled: Prefilled | None
    ) -> Response:
        """D's whole answer. A D that fails before answering (a reset, a timeout, a 5xx, an
        ejection or a drain with migration) is replaced by another, which runs the request
        again from its prompt alone, up to `--migration-limit` times."""
        content = self._decode_content(req, prefilled, first_sent=False)
        failed = FailedWorkers()
        while True:
            limit_left = failed.num_failures < self.cfg.migration_limit
            exclude = (*failed.excluded, decode)

            def movable(limit_left=limit_left, exclude=exclude) -> bool:
                return limit_left and bool(self.pools["decode"].routable(exclude))

            try:
                return await self.inflight.call(
                    decode, self._answer_whole(req, decode, prefilled, content), movable
                )
            except UpstreamError as e:
                self.give_back(prefilled)
                if isinstance(e, WorkerEjected):
                    self.failed(e)
                failed.add(e.worker)
                reason = _migration_reason(e)
                refusal = self._whole_refusal(e, failed.num_failures)
                if refusal is None:
                    try:
                        decode = await self.choose_soon("decode", req, failed.excluded)
                    except UnavailableError:
                        refusal = "no_decode"
                if refusal is not None:
                    if reason is not None:
                        self.metrics.migrations_refused.labels(refusal).inc()
                    return upstream_error_response(e)
                self.metrics.migrations.labels(reason).inc()
                self.metrics.migration_recomputed.inc(req.estimated_tokens())
                logger.warning(
                    "request %s runs again on %s (%s)", req.request_id, decode.url, reason
                )
                prefilled, content = None, req.decode_body(None)

    def _whole_refusal(self, e: UpstreamError, num_failed: int) -> str | None:
        """Why a non-streamed request whose D failed does not run again elsewhere, or None."""
        if _migration_reason(e) is None:
            return "not_a_failure"  # the request's own fault, or a worker never reached
        if num_failed > self.cfg.migration_limit:
            return "limit"
        return None

    async def _answer_whole(
        self, req: ProxyRequest, decode: Worker, prefilled: Prefilled | None, content: bytes
    ) -> Response:
        # NOTE: D answers only once it has generated everything: the whole wait is a read
        resp, decode = await self._open_decode(
            req, decode, prefilled, content=content, timeout=self._whole_timeout
        )
        try:
            body = await resp.aread()
        except httpx.HTTPError as e:
            raise UpstreamError(decode, f"decode failed: {e!r}") from e
        finally:
            decode.num_outstanding -= 1
            await resp.aclose()
        return Response(body, media_type="application/json")

    async def _open_decode(
        self,
        req: ProxyRequest,
        decode: Worker,
        prefilled: Prefilled | None,
        first_sent: bool = False,
        content: bytes | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> tuple[httpx.Response, Worker]:
        """D's response, headers received; another D when one cannot be reached (unless the KV
        was pushed into that one). The caller decrements the worker's outstanding count."""
        if content is None:
            content = self._decode_content(req, prefilled, first_sent)
        can_switch = prefilled is None or prefilled.push_to is None
        tried: tuple[Worker, ...] = ()
        while True:
            tried += (decode,)
            decode.num_outstanding += 1
            # NOTE: open until D's answer ends, which is the request's end (the trace ends it)
            span = req.trace.child("proxy.decode", "client", **{"server.address": decode.url})
            req.trace.set(**{"pdserve.decode_url": decode.url})
            try:
                headers = {"X-Request-Id": req.request_id, **self.internal}
                headers.update(req.trace.headers(span))
                return await open_stream(
                    decode, req.path, content, headers, timeout or self.stream_timeout
                ), decode
            except BaseException as e:  # the client leaving (cancelled) included
                why = e.kind if isinstance(e, UpstreamError) else type(e).__name__
                req.trace.end_span(span, error=why)
                decode.num_outstanding -= 1
                if not isinstance(e, UpstreamError):
                    raise
                self.failed(e)
                others = self.pools["decode"].routable(exclude=tried)
                # NOTE: a 503 before any byte: a D that drains (or stops) takes nothing new
                refused = e.is_connect or e.status == 503
                retry = refused and can_switch and len(tried) <= self.cfg.max_retries
                if not (retry and others):
                    raise
                self.metrics.retries.labels("decode").inc()
                decode = self.choose("decode", req, tried)

    async def _stream_after_first(
        self,
        req: ProxyRequest,
        decode: Worker,
        prefilled: Prefilled,
        start: float,
        client: ClientStream,
    ) -> AsyncIterator[bytes]:
        first = first_token_events(req.is_chat, req.request_id, prefilled.answer, req.body)
        client.first_token(first, prefilled.params.get("first_token_id"))
        yield first
        self.metrics.ttft.observe(time.perf_counter() - start)
        try:
            resp, decode = await self._open_decode(req, decode, prefilled, first_sent=True)
        except UpstreamError as e:
            self.give_back(prefilled)
            self.metrics.stream_errors.inc()
            error = error_object(e.body)
            if error is not None and e.status is not None:  # D's own error, its fault said
                yield passed_on_event(error, e.status)
            else:
                yield error_event(e.message, e.status or 502)
            return
        except Exception:  # noqa: BLE001 — a bug: the stream still ends clearly
            logger.exception("reaching decode worker %s failed", decode.url)
            self.give_back(prefilled)
            self.metrics.stream_errors.inc()
            yield error_event("internal error in the proxy", 500, code="internal_error")
            return
        except BaseException:  # the client went away while D was being reached
            self.give_back(prefilled)
            raise
        rest = self._relay(req, Upstream(resp, decode, (0,), prefilled), client, None)
        async with aclosing(rest) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _relay(
        self, req: ProxyRequest, first: Upstream, client: ClientStream, start: float | None
    ) -> AsyncIterator[bytes]:
        """D's events to the client as they come; a failed D's choices move to another
        (proxy/migration.py), or the stream ends with an error event."""

        def first_byte() -> None:
            self.metrics.ttft.observe(time.perf_counter() - start)

        relay = MigratingRelay(self, req, client)
        async with aclosing(relay.run(first, None if start is None else first_byte)) as chunks:
            async for chunk in chunks:
                yield chunk

    # -- failures and clean-up -------------------------------------------------------------------
    def failed(self, e: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(e.worker.role, e.kind).inc()
        self.metrics.upstream_faults.labels(e.worker.role, e.fault).inc()
        if e.is_connect:
            logger.warning("ejecting %s worker %s: %s", e.worker.role, e.worker.url, e.message)
            e.worker.eject(e.message)

    def give_back(self, prefilled: Prefilled | None) -> None:
        """Free what a request that will not be decoded holds on P (pull) or D (push)."""
        if prefilled is None:
            return
        if prefilled.push_to is not None:
            assert prefilled.reserved_on is not None, "a push reservation names its D"
            reservation = {"reservation_id": prefilled.push_to["reservation_id"]}
            self._release(prefilled.reserved_on, reservation)
        elif rid := prefilled.params.get("remote_request_id"):
            self._release(prefilled.worker, {"request_id": rid})

    def _release(self, worker: Worker, payload: dict) -> None:
        self.spawn(self._post_quietly(worker, "/internal/kv/release", payload))

    async def _post_quietly(self, worker: Worker, path: str, payload: dict) -> None:
        try:
            await post_json(worker, path, payload, self.internal, self._internal_timeout)
        except UpstreamError as e:  # the lease or reservation expires anyway
            logger.info("%s", e.message)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)


class UpstreamAPIError(APIError):
    """A worker's 4xx for the client's mistake, passed on as the worker wrote it."""

    def __init__(self, e: UpstreamError):
        super().__init__(error_message(e.body) or e.message)
        self.status_code = e.status or 502
        self.body = e.body


def upstream_error_response(e: UpstreamError) -> Response:
    if e.status is not None and e.body and error_message(e.body) is not None:
        return Response(e.body, status_code=e.status, media_type="application/json")
    if e.is_connect:
        err: APIError = UnavailableError(f"no worker could take the request: {e.message}")
    else:
        err = ServerError(f"upstream failure: {e.message}", code="upstream_failed")
        err.status_code = 504 if e.kind == "timeout" else 502
    return Response(
        err.to_response().model_dump_json(),
        status_code=int(err.status_code),
        media_type="application/json",
    )


def _migration_reason(e: UpstreamError) -> str | None:
    """Why a D failed a request that another D can take: None for the request's own fault
    (a 4xx) and for a D never reached (already retried on another, proxy/orchestrator.py)."""
    if isinstance(e, WorkerEjected):
        return "drain" if e.reason == "drain" else "ejected"
    if e.is_client_error or e.is_connect or e.status in (401, 403):
        return None
    if e.kind == "timeout":
        return "timeout"
    return "error_event" if e.status is not None else "connection"


def _sse(body) -> EventStreamResponse:
    return EventStreamResponse(body)
