"""The proxy's FastAPI app: the OpenAI routes, health and readiness, metrics, admin routes.

The `lifespan` creates one `httpx.AsyncClient` per worker (keep-alive, explicit timeouts),
starts the health checks, and closes everything on shutdown. Clients authenticate with
`Authorization: Bearer KEY` when `--api-key` is set; bodies above `--max-body-bytes` get 413;
`X-Request-Id` is taken from the client (or made) and sent to P, D and back. Admission control
(rate limits, a priority queue for slots) is proxy/admission.py: a request is checked against
its key's rate before its body is read, and waits for a slot once it parsed.
"""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.api.errors import (
    APIError,
    ServerError,
    UnavailableError,
)
from common.api.http import (
    error_response,
    install_error_handlers,
    json_body_openapi,
    read_body,
)
from common.api.limits import check_request_id
from common.api.protocol import ChatCompletionRequest, CompletionRequest
from common.tracing import NO_TRACE, start_trace
from proxy.admin import install_admin_routes
from proxy.admission import HeldResponse, Slot
from proxy.config import ProxyConfig
from proxy.journey.calls import UpstreamAPIError
from proxy.processes import ProcessInfo
from proxy.request import CHAT_PATH, COMPLETIONS_PATH, GENERATION_PATHS, ProxyRequest
from proxy.siblings import merge_metrics
from proxy.state import Proxy, bearer_key, check_key

logger = logging.getLogger(__name__)


def build_app(cfg: ProxyConfig, process: ProcessInfo | None = None) -> GenerationFastPath:
    """The app; `process` when it is one of `--workers N` processes (proxy/processes.py)."""
    proxy = Proxy(cfg, process)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.stop()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.proxy = proxy
    install_error_handlers(app)
    _install_openai_routes(app, proxy)
    _install_status_routes(app, proxy)
    install_admin_routes(app, proxy)
    return GenerationFastPath(app, proxy)


async def serve(proxy: Proxy, request: Request, path: str) -> Response:
    """One generation request, start to end: every outcome is a response (OpenAI's error shape
    for failures), counted by status. An admitted request holds its slot until the response
    has been sent."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    attributes = {"http.route": path, "pdserve.request_id": rid, "pdserve.mode": proxy.cfg.mode}
    trace = start_trace(proxy.tracer, "proxy.request", request.headers, attributes=attributes)
    slot: Slot | None = None
    try:
        check_key(request, proxy.cfg.api_key)
        key = bearer_key(request)
        rank = proxy.admission.rank_of(key, request.headers.get("x-priority"))
        proxy.admission.check_rate(key)
        check_request_id(rid, proxy.cfg.limits)
        raw = await read_body(request, proxy.cfg.max_body_bytes)
        session = request.headers.get("x-session-id")
        req = ProxyRequest.parse(path, raw, rid, trace, session, proxy.cfg.limits)
        slot = await _admitted(proxy, request, rank, trace)
        response = await proxy.orchestrator.handle(req)
    except UpstreamAPIError as e:  # a worker's 4xx, as the worker wrote it
        response = Response(e.body, status_code=e.status_code, media_type="application/json")
    except APIError as e:
        response = error_response(e)
    except Exception:  # noqa: BLE001 — a bug here must still answer in OpenAI's shape
        logger.exception("unhandled error on %s", path)
        response = error_response(ServerError("internal error in the proxy"))
    except BaseException:
        if slot is not None:
            slot.release()
        trace.end(**{"http.status_code": 499})
        raise
    response.headers["X-Request-Id"] = rid
    proxy.metrics.requests.labels(path, str(response.status_code)).inc()
    proxy.count_answered()
    if slot is None and trace is NO_TRACE:
        return response

    def sent(status: int = response.status_code) -> None:
        if slot is not None:
            slot.release()
        trace.end(**{"http.status_code": status})

    return HeldResponse(response, sent)


async def _admitted(proxy: Proxy, request: Request, rank: int, trace) -> Slot | None:
    """A slot once admission lets the request start (None: no limit); the wait is a span."""
    span = trace.child("proxy.queue")
    try:
        return await proxy.admission.enter(rank, lambda: _until_disconnect(request.receive))
    finally:
        trace.end_span(span)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class GenerationFastPath:
    """The ASGI entry point: the two generation routes go straight to `serve`, skipping
    FastAPI's middleware and routing (a fifth of the proxy's CPU per request on stub workers);
    everything else, lifespan included, goes to the FastAPI app, which declares the same
    routes for its OpenAPI schema."""

    def __init__(self, app: FastAPI, proxy: Proxy):
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path")
        if scope["type"] == "http" and path in GENERATION_PATHS and scope["method"] == "POST":
            response = await serve(self.proxy, Request(scope, receive), path)
            await response(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _install_openai_routes(app: FastAPI, proxy: Proxy) -> None:
    @app.post(COMPLETIONS_PATH, openapi_extra=json_body_openapi(CompletionRequest))
    async def completions(request: Request):
        return await serve(proxy, request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH, openapi_extra=json_body_openapi(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serve(proxy, request, CHAT_PATH)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, proxy.cfg.api_key)
        for worker in proxy.pools["decode"].routable():
            r = await worker.client.get("/v1/models", timeout=proxy.cfg.connect_timeout + 3)
            if r.status_code == 200:
                return Response(r.content, media_type="application/json")
        raise UnavailableError("no healthy decode worker to list the models")


def _install_status_routes(app: FastAPI, proxy: Proxy) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "role": "proxy"}

    @app.get("/ready")
    async def ready(request: Request):
        """Ready when this process sees a routable D (and P, in a P/D mode); with `--workers N`,
        only when every sibling is ready too (any of them may take the next connection)."""
        ready, waiting = proxy.is_ready, []
        if ready and proxy.siblings is not None and not proxy.siblings.is_peer(request.headers):
            waiting = await proxy.siblings.not_ready()
            ready = not waiting
        body = {
            "ready": ready,
            "mode": proxy.cfg.mode,
            "process": {"index": proxy.process_index, "pid": os.getpid()},
            "workers": [w.describe() for w in proxy.all_workers()],
        }
        if waiting:
            body["siblings_not_ready"] = waiting
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        """This process's metrics; with `--workers N`, merged with its siblings'."""
        text = proxy.metrics.render()
        if proxy.siblings is not None and not proxy.siblings.is_peer(request.headers):
            text = merge_metrics([text.decode(), *await proxy.siblings.metrics()])
        return Response(text, media_type="text/plain; version=0.0.4")
