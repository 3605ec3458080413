"""The FastAPI app both workers serve: OpenAI routes (and vLLM's render routes), health,
metrics, errors, draining.

The app listens at once and loads the engine in the background: until it is ready (and again
while draining) every request but `/metrics` answers 503. Errors of every kind leave in OpenAI's
shape; request ids from `X-Request-Id` are honoured and echoed.

What the routes share, and how a dead engine thread ends the process, is common/api/state.py.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.api.errors import APIError, UnavailableError
from common.api.http import error_response, install_error_handlers
from common.api.internal import install_internal_routes
from common.api.limits import check_request_id
from common.api.render import install_render_routes
from common.api.routes import install_openai_routes
from common.api.server_config import ServerConfig
from common.api.state import ServerState
from common.cpu import available_cores, format_cpu_list
from common.engine.client import EngineDeadError, EngineFactory
from common.native.choice import summary as kernel_paths
from common.tracing import setup_tracing

logger = logging.getLogger(__name__)


def build_app(cfg: ServerConfig, engine_factory: EngineFactory) -> FastAPI:
    state = ServerState(cfg, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.tracer = state.tracer or setup_tracing(cfg.otlp_traces_endpoint, cfg.role)
        loading = asyncio.create_task(state.load())
        yield
        state.is_draining = True
        loading.cancel()
        if state.engine is not None:
            await state.engine.stop()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if state.tracer is not None:
            await asyncio.to_thread(state.tracer.shutdown)  # the spans still batched are sent

    app = FastAPI(title=f"pdserve {cfg.role} worker", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    _install_engine_dead_handler(app)
    _install_request_ids(app, state)
    _install_basic_routes(app, state)
    install_openai_routes(app, state)
    install_render_routes(app, state)
    install_internal_routes(app, state)
    return app


def _install_engine_dead_handler(app: FastAPI) -> None:
    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(UnavailableError(str(exc)))


def _install_request_ids(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_request_id(rid, state.cfg.limits)
        except APIError as e:
            return error_response(e)
        request.state.request_id = rid
        response = await call_next(request)
        response.headers["X-Request-Id"] = rid
        if request.url.path.startswith("/v1/"):  # by route, so unknown paths add no labels
            route = request.scope.get("route")
            state.metrics.count(getattr(route, "path", "other"), response.status_code)
        return response


def _install_basic_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        engine = state.require_ready()
        cpu = {"threads": engine.num_threads, "cores": format_cpu_list(available_cores())}
        return {"status": "ok", "role": state.cfg.role, "cpu": cpu, "kernels": kernel_paths()}

    @app.get("/metrics")
    async def metrics():
        stats = state.engine.stats if state.engine is not None else None
        state.metrics.arriving.set(state.num_on_the_way())
        return Response(
            state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models():
        engine = state.require_ready()
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "pdserve",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }
