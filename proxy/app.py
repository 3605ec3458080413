"""The proxy's FastAPI app: the OpenAI routes, health and readiness, metrics, admin routes.

The `lifespan` creates one `httpx.AsyncClient` per worker (keep-alive, explicit timeouts),
starts the health checks, and closes everything on shutdown. Clients authenticate with
`Authorization: Bearer KEY` when `--api-key` is set; bodies above `--max-body-bytes` get 413;
`X-Request-Id` is taken from the client (or made) and sent to P, D and back.
"""

from __future__ import annotations

import hmac
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.api.app import error_response, install_error_handlers
from common.api.errors import AuthenticationError, PayloadTooLargeError, UnavailableError
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator, UpstreamAPIError
from proxy.request import CHAT_PATH, COMPLETIONS_PATH, ProxyRequest
from proxy.upstream import make_client
from proxy.workers import ROLES, Worker, WorkerPool, normalize_url


class Proxy:
    """What the routes share: config, worker pools, health checks, orchestration, metrics."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.pools = {role: WorkerPool(role) for role in ROLES}
        self.metrics = ProxyMetrics(self.pools)
        self.orchestrator = Orchestrator(cfg, self.pools, self.metrics)
        self.health = HealthChecker(cfg.health, self.all_workers)
        self.removed: list[Worker] = []  # by an admin; their clients close at shutdown
        self.started_at = int(time.time())

    def all_workers(self) -> list[Worker]:
        return [w for pool in self.pools.values() for w in pool.workers]

    def add_worker(self, role: str, url: str) -> Worker:
        url = normalize_url(url)
        worker = Worker(url, role, make_client(url, self.cfg.connect_timeout))
        self.pools[role].add(worker)
        return worker

    @property
    def is_ready(self) -> bool:
        needs_prefill = self.cfg.mode != "colocated" and len(self.pools["prefill"]) > 0
        has_prefill = bool(self.pools["prefill"].routable())
        return bool(self.pools["decode"].routable()) and (has_prefill or not needs_prefill)

    async def start(self) -> None:
        for role in ROLES:
            for url in getattr(self.cfg, role):
                self.add_worker(role, url)
        await self.health.check_all()  # /ready is true from the first moment it can be
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.orchestrator.close()
        for worker in self.all_workers() + self.removed:
            await worker.client.aclose()


def build_app(cfg: ProxyConfig) -> FastAPI:
    proxy = Proxy(cfg)

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
    from proxy.admin import install_admin_routes

    install_admin_routes(app, proxy)
    return app


def check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), key):
        raise AuthenticationError(
            "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
        )


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _install_openai_routes(app: FastAPI, proxy: Proxy) -> None:
    async def serve(request: Request, path: str) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_key(request, proxy.cfg.api_key)
            raw = await read_body(request, proxy.cfg.max_body_bytes)
            response = await proxy.orchestrator.handle(ProxyRequest.parse(path, raw, rid))
        except UpstreamAPIError as e:  # a worker's 4xx, as the worker wrote it
            response = Response(e.body, status_code=e.status_code, media_type="application/json")
        except (AuthenticationError, PayloadTooLargeError) as e:
            response = error_response(e)
        except Exception as e:  # noqa: BLE001 — counted here, shaped by the app's handlers
            proxy.metrics.requests.labels(path, _status_of(e)).inc()
            raise
        response.headers["X-Request-Id"] = rid
        proxy.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request):
        return await serve(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request):
        return await serve(request, CHAT_PATH)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, proxy.cfg.api_key)
        for worker in proxy.pools["decode"].routable():
            r = await worker.client.get("/v1/models", timeout=proxy.cfg.connect_timeout + 3)
            if r.status_code == 200:
                return Response(r.content, media_type="application/json")
        raise UnavailableError("no healthy decode worker to list the models")


def _status_of(e: Exception) -> str:
    return str(int(getattr(e, "status_code", 500)))


def _install_status_routes(app: FastAPI, proxy: Proxy) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "role": "proxy"}

    @app.get("/ready")
    async def ready():
        body = {
            "ready": proxy.is_ready,
            "mode": proxy.cfg.mode,
            "workers": [w.describe() for w in proxy.all_workers()],
        }
        return JSONResponse(body, status_code=200 if proxy.is_ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4")
