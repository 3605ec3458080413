"""What a worker's routes share (`ServerState`): its config, metrics, readiness, the engine's
client once loaded (common/engine/client.py: the routes' one door to the engine, KV peers
included), and the pool that runs blocking work off the event loop. The app
(common/api/app.py) builds it; every route module imports it from here, so the imports point
one way.

If the engine thread dies, the worker fails closed: requests (and `/health`) get 503 in
OpenAI's shape, and `ENGINE_DEAD_LINGER_S` later the server is asked to exit (`request_exit`,
set by common/api/server.py): it drains in-flight responses and the process exits with status
`ENGINE_DEAD_EXIT_CODE` (1), so that docker-compose or Kubernetes restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request

from common.api.errors import NotFoundError, UnavailableError, WorkerDrainingError
from common.api.ignored_fields import IgnoredFields
from common.api.metrics import ServerMetrics
from common.api.server_config import ServerConfig
from common.cpu import available_cores, format_cpu_list
from common.engine.client import EngineClient, EngineFactory

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENGINE_DEAD_EXIT_CODE = 1  # the process's exit status after its engine thread died
ENGINE_DEAD_LINGER_S = 1.0  # /health answers 503 this long before the port closes


class ServerState:
    """What the routes share: config, metrics, readiness, the engine's client once the engine
    has loaded, and the small pool that runs blocking work (tokenizing, chat templates, file
    reads) off the event loop."""

    def __init__(self, cfg: ServerConfig, engine_factory: EngineFactory):
        self.cfg = cfg
        self.engine_factory = engine_factory
        self.metrics = ServerMetrics(cfg.role)
        self.ignored_fields = IgnoredFields(self.metrics.ignored_fields)
        self.engine: EngineClient | None = None  # once loaded
        self.model_name = cfg.served_model_name or "starting"
        self.load_error: BaseException | None = None
        self.is_draining = False
        self.num_admitted = 0  # admitted requests not yet handed to the engine (serving.py)
        self.num_arriving = 0  # generation requests received, not yet admitted (`arriving`)
        self.started_at = int(time.time())
        self.exit_code = 0  # the process's exit status once the server stops
        self.request_exit: Callable[[], None] | None = None  # the server stops, draining
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        # NOTE: not the engine thread, which owns torch; these threads never run a torch op
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.tracer = None  # common.tracing.otel.OtelTracer when --otlp-traces-endpoint is set

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_alive and not self.is_draining

    def require_ready(self) -> EngineClient:
        if self.is_draining:
            raise UnavailableError(
                "the server is draining and takes no new requests", headers={"Retry-After": "1"}
            )
        if self.engine is None:
            why = f"failed to load: {self.load_error}" if self.load_error else "is starting"
            raise UnavailableError(f"the engine {why}", headers={"Retry-After": "5"})
        if not self.engine.is_alive:
            raise UnavailableError(f"the engine is not running: {self.engine.error!r}")
        return self.engine

    async def load(self) -> None:
        self.loop = asyncio.get_running_loop()
        engine = EngineClient(
            self.engine_factory,
            on_death=self.engine_died,
            num_threads=self.cfg.cpu.effective_threads,
            on_the_way=self.num_on_the_way,
            arrival_wait=self.cfg.arrival_wait,
            peer_headers=self.cfg.internal_headers,
            on_handshake=self.metrics.handshakes.inc,
        )
        try:
            await engine.start()
        except Exception as e:  # noqa: BLE001 — reported by /health and every request
            logger.exception("engine failed to load")
            self.load_error = e
            return
        if self.cfg.served_model_name is None:
            self.model_name = engine.model_name
        self.engine = engine
        self.metrics.set_cpu(engine.num_threads, len(available_cores()))
        compile_seconds = engine.compile_seconds
        self.metrics.compile_seconds.set(compile_seconds)
        logger.info(
            "%s worker ready: model %s, %d torch threads on cores %s, %s",
            self.cfg.role,
            self.model_name,
            engine.num_threads,
            format_cpu_list(available_cores()),
            f"compiled in {compile_seconds:.1f} s" if compile_seconds else "eager",
        )

    def engine_died(self, error: BaseException) -> None:
        """On the event loop, once the engine thread has failed: exit non-zero, soon."""
        self.exit_code = ENGINE_DEAD_EXIT_CODE
        logger.critical(
            "the engine died (%r): answering 503, exiting with status %d after draining",
            error,
            ENGINE_DEAD_EXIT_CODE,
        )
        if self.request_exit is not None:
            asyncio.get_running_loop().call_later(ENGINE_DEAD_LINGER_S, self.request_exit)

    def migrate_all(self) -> None:
        """`--drain-migrate` on SIGTERM (on the event loop): every generation in flight, and any
        that would still start, ends now with `WorkerDrainingError`, its blocks freed, so that
        the proxy moves it to another worker and the server's drain ends in moments."""
        if self.engine is not None:
            logger.info("draining: ending %d generations for migration", self.engine.num_unfinished)
            self.engine.end_all(WorkerDrainingError)

    @contextlib.contextmanager
    def arriving(self, request: Request) -> Iterator[None]:
        """Count a generation request from the moment its route starts (body, parsing, chat
        template, tokenizing) until `arrived` (its jobs admitted) or the route ends."""
        self.num_arriving += 1
        request.state.is_arriving = True
        if self.tracer is not None:
            request.state.arrived_ns = time.time_ns()  # where its trace's root starts
        try:
            yield
        finally:
            self.arrived(request)

    def arrived(self, request: Request) -> None:
        if getattr(request.state, "is_arriving", False):
            request.state.is_arriving = False
            self.num_arriving -= 1

    def num_on_the_way(self) -> int:
        """Requests this worker has received that its engine has not seen yet. The engine
        thread reads it (one int read each, under the GIL) to decide whether to wait for them."""
        return self.num_arriving + self.num_admitted

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the tokenize pool, the event loop free meanwhile; raises what `fn`
        raises (a request's ValueError or InvalidRequestError stays a 400)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
