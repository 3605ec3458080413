"""D's events to the client as they come: from one decode stream, or from several once a failed
D's choices moved to others (migration.py).

- **P's first token first.** Streamed, P's first token goes to the client at once and D
  continues after it (`after_first_token`).
- **When a D fails.** A connection error or reset, silence past `--decode-timeout`, an error
  event that is the worker's fault (a 5xx `status`, or an older worker's untyped event; one
  drained with `--drain-migrate` sends `worker_draining`), a stream that ends without `[DONE]`
  before its choices did, an ejection by the health checks, or `POST /admin/workers/drain` with
  `migrate` (both through `InFlight.cut`): its unfinished choices move. A refused move ends the
  stream with today's error event, never with an answer that claims success.
- **The request's fault is final.** An error event with a 4xx `status` (its output left its
  grammar, a limit) goes to the client as D wrote it and ends the stream: nothing moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx
import msgspec

from common.api.errors import fault_of
from proxy.inflight import InFlight
from proxy.journey.calls import WorkerCalls
from proxy.journey.client import ClientStream, read_view
from proxy.journey.decode import Decodes, Upstream
from proxy.journey.migration import Migration, Refused
from proxy.journey.prefill import Prefilled, Prefills
from proxy.metrics import ProxyMetrics
from proxy.request import ProxyRequest
from proxy.sse import DONE, error_event, first_token_events, passed_on_event
from proxy.upstream import UpstreamError, error_object
from proxy.workers import Worker

logger = logging.getLogger(__name__)


class Relay:
    """The client's stream from one or more decode streams, moving choices when one fails."""

    def __init__(
        self,
        req: ProxyRequest,
        client: ClientStream,
        migration: Migration,
        decodes: Decodes,
        prefills: Prefills,
        calls: WorkerCalls,
        inflight: InFlight,
        metrics: ProxyMetrics,
    ):
        self.req = req
        self.client = client
        self.migration = migration
        self.decodes = decodes
        self.prefills = prefills
        self.calls = calls
        self.inflight = inflight
        self.metrics = metrics
        self.active: set[Upstream] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: bytes | None = None  # the last error event a D sent, for a refusal

    async def after_first_token(
        self, decode: Worker, prefilled: Prefilled, start: float
    ) -> AsyncIterator[bytes]:
        """P's first token at once, then D's stream after it."""
        req = self.req
        first = first_token_events(req.is_chat, req.request_id, prefilled.answer, req.body)
        self.client.first_token(first, prefilled.params.get("first_token_id"))
        yield first
        self.metrics.ttft.observe(time.perf_counter() - start)
        try:
            resp, decode = await self.decodes.open(req, decode, prefilled, first_sent=True)
        except UpstreamError as e:
            self.prefills.give_back(prefilled)
            self.metrics.stream_errors.inc()
            error = error_object(e.body)
            if error is not None and e.status is not None:  # D's own error, its fault said
                yield passed_on_event(error, e.status)
            else:
                yield error_event(e.message, e.status or 502)
            return
        except Exception:  # noqa: BLE001 — a bug: the stream still ends clearly
            logger.exception("reaching decode worker %s failed", decode.url)
            self.prefills.give_back(prefilled)
            self.metrics.stream_errors.inc()
            yield error_event("internal error in the proxy", 500, code="internal_error")
            return
        except BaseException:  # the client went away while D was being reached
            self.prefills.give_back(prefilled)
            raise
        async with aclosing(self.run(Upstream(resp, decode, (0,), prefilled))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def run(self, first: Upstream, start: float | None = None) -> AsyncIterator[bytes]:
        """The client's bytes; the time to the first one observed from `start`, if given."""
        finished = False
        try:
            self._start(first)
            while self.active:
                kind, up, data = await self.queue.get()
                if up not in self.active:
                    continue  # what a stream already given up on still sent
                if kind == "events":
                    out, failure = self._events(up, data)
                    if out:
                        if start is not None:
                            self.metrics.ttft.observe(time.perf_counter() - start)
                            start = None
                        yield out
                    if failure == "request_fault":
                        finished = True
                        yield DONE
                        return
                    if failure is None:
                        continue
                    kind, data = "failed", failure
                if kind == "end":
                    self._close(up, ok=True)
                    if up.is_done or not any(i in self.client.unfinished for i in up.choices):
                        continue
                    data = "truncated"
                else:
                    self._close(up)
                try:
                    await self._move(up, data)
                except Refused as e:
                    self.metrics.migrations_refused.labels(e.reason).inc()
                    self.metrics.stream_errors.inc()
                    finished = True
                    # D's own error event where it sent one (its message says what failed)
                    yield self.error or error_event(e.message, code="decode_failed")
                    return
            if self.client.wants_usage and not self.client.usage_sent:
                usage = self.client.usage_event()  # after a migration, or a D gone before it
                if usage:
                    yield usage
            finished = True
            yield DONE
        finally:
            for up in list(self.active):
                self._close(up)
            if not finished:  # the client went away: each D sees its stream close and aborts
                self.metrics.disconnects.inc()

    async def _move(self, up: Upstream, reason: str) -> None:
        """Each unfinished choice of a failed stream continues on another D; `Refused` if not."""
        if reason != "error_event" and reason != "drain":
            self.error = None  # this failure has no event of its own
        for index in self.migration.begin(up, reason):
            self._start(await self.migration.resume(index))
            self.metrics.migrations.labels(reason).inc()

    # -- one decode stream -----------------------------------------------------------------------
    def _start(self, up: Upstream) -> None:
        self.active.add(up)
        up.task = asyncio.get_running_loop().create_task(self._pump(up))
        up.unwatch = self.inflight.watch(up.worker, lambda reason: self._cut(up, reason))

    def _cut(self, up: Upstream, reason: str) -> None:
        """Ejected or drained: the stream moves now, if it can (else it goes on waiting)."""
        if up not in self.active or up.task is None or up.task.done():
            return
        if self.migration.can_move(up.worker):
            up.cut_reason = reason
            up.task.cancel()

    async def _pump(self, up: Upstream) -> None:
        """D's events into the queue, those of one read together; then "end" or why it
        failed."""
        pending = b""
        put = self.queue.put_nowait
        try:
            async for chunk in up.resp.aiter_raw():
                *events, pending = (pending + chunk).split(b"\n\n")
                if events:
                    put(("events", up, events))
            put(("end", up, None))
        except asyncio.CancelledError:
            if up.cut_reason is None:
                raise
            put(("failed", up, up.cut_reason))
        except httpx.TimeoutException as e:
            logger.warning("decode worker %s went silent mid-stream: %r", up.worker.url, e)
            put(("failed", up, "timeout"))
        except Exception as e:  # noqa: BLE001 — httpx's errors, and a bug: the stream moves
            if isinstance(e, httpx.HTTPError):
                logger.warning("decode worker %s failed mid-stream: %r", up.worker.url, e)
            else:
                logger.exception("reading decode worker %s failed", up.worker.url)
            put(("failed", up, "connection"))

    def _events(self, up: Upstream, events: list[bytes]) -> tuple[bytes, str | None]:
        """The client's bytes for events of one read, and why D failed (see `_event`): the
        events after a failure are not sent."""
        out = []
        for raw in events:
            up.is_done = up.is_done or raw == b"data: [DONE]"
            sent, failure = self._event(raw)
            if sent:
                out.append(sent)
            if failure is not None:
                return b"".join(out), failure
        return b"".join(out), None

    def _event(self, raw: bytes) -> tuple[bytes | None, str | None]:
        """What to send the client for one of D's events, and why D failed (None: it did not;
        "request_fault": an error the request caused, sent and final: another D would end it
        the same way, after the work of a move)."""
        if not raw.startswith(b"data: "):
            return raw + b"\n\n", None
        data = raw[6:]
        if data == b"[DONE]":  # the proxy sends its own once every stream has ended
            return None, None
        try:
            view = read_view(data)
        except msgspec.DecodeError:  # not a chunk: passed on as it is, and nothing can move
            self.client.is_tracked = False
            return raw + b"\n\n", None
        error = view.error
        if error is not None:
            fault = fault_of(error)
            self.metrics.upstream_faults.labels("decode", fault).inc()
            if fault == "request":
                return raw + b"\n\n", "request_fault"
            logger.warning("decode worker error event: %s", error.get("message"))
            self.error = raw + b"\n\n" + DONE
            draining = "worker_draining" in (error.get("type"), error.get("code"))
            return None, "drain" if draining else "error_event"
        return self.client.accept(data, view), None

    def _close(self, up: Upstream, ok: bool = False) -> None:
        """Done with a decode stream; what it holds on P (pull) or D (push) is freed unless it
        ended well (D read it)."""
        if up not in self.active:
            return
        self.active.discard(up)
        if up.unwatch is not None:
            up.unwatch()
        if up.task is not None and not up.task.done():
            up.task.cancel()
        up.worker.num_outstanding -= 1
        if not ok:
            self.prefills.give_back(up.prefilled)
        self.calls.spawn(up.resp.aclose())
