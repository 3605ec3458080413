"""How each stage of the journey calls a worker: the headers (the request's id, the cluster
token, the trace context), the timeouts, a client span per call, a failed worker counted (and
ejected when it could not be reached), and the releases sent in the background.

- **Whose fault.** A worker's 4xx, before a stream or as an error event in one, is the
  request's own fault (but a 401, 403, 408 or 429, which speak of the worker): returned (or
  passed on in the stream) as the worker wrote it (`UpstreamAPIError`,
  `upstream_error_response`), never retried on another worker nor moved; only the worker's
  faults (a 5xx, a reset, a timeout, an ejection, and those four) are retried or moved.
  `pdserve_proxy_upstream_faults_total{role, fault}` counts each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager

import httpx
from fastapi.responses import Response

from common.api.errors import APIError, ServerError, UnavailableError
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from proxy.request import ProxyRequest
from proxy.upstream import UpstreamError, error_message, post_json
from proxy.workers import Worker

logger = logging.getLogger(__name__)


class WorkerCalls:
    def __init__(self, cfg: ProxyConfig, metrics: ProxyMetrics):
        self.metrics = metrics
        self.internal = {"X-Internal-Token": cfg.internal_token} if cfg.internal_token else {}
        self.stream_timeout = httpx.Timeout(cfg.decode_timeout, connect=cfg.connect_timeout)
        self.prefill_timeout = httpx.Timeout(cfg.prefill_timeout, connect=cfg.connect_timeout)
        self.internal_timeout = httpx.Timeout(5.0, connect=cfg.connect_timeout)
        self.whole_timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        self._background: set[asyncio.Task] = set()

    def headers(self, req: ProxyRequest, span) -> dict[str, str]:
        """A generation call's headers: the request's id, the cluster token, `span`'s context."""
        return {"X-Request-Id": req.request_id, **self.internal, **req.trace.headers(span)}

    @contextmanager
    def span(self, req: ProxyRequest, name: str, worker: Worker) -> Iterator[object]:
        """The client span of one call to `worker`, ended when the call is (with the error's
        kind when it failed)."""
        span = req.trace.child(name, "client", **{"server.address": worker.url})
        try:
            yield span
        except UpstreamError as e:
            req.trace.end_span(span, error=e.kind)
            raise
        finally:
            req.trace.end_span(span)

    def failed(self, e: UpstreamError) -> None:
        """A worker failed a call: counted, and ejected when it could not be reached."""
        self.metrics.upstream_errors.labels(e.worker.role, e.kind).inc()
        self.metrics.upstream_faults.labels(e.worker.role, e.fault).inc()
        if e.is_connect:
            logger.warning("ejecting %s worker %s: %s", e.worker.role, e.worker.url, e.message)
            e.worker.eject(e.message)

    def release(self, worker: Worker, payload: dict) -> None:
        """A lease (`request_id`) or reservation (`reservation_id`) ended, in the background."""
        self.spawn(self._post_quietly(worker, "/internal/kv/release", payload))

    async def _post_quietly(self, worker: Worker, path: str, payload: dict) -> None:
        try:
            await post_json(worker, path, payload, self.internal, self.internal_timeout)
        except UpstreamError as e:  # the lease or reservation expires anyway
            logger.info("%s", e.message)

    def spawn(self, coro: Coroutine) -> None:
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
