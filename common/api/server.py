"""Run a worker: parse the command line, build the app, serve it with uvicorn.

SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones get `--drain-timeout` seconds
to finish and are then aborted (their blocks freed), and the process exits 0. With
`--drain-migrate` they end at once instead, with a `worker_draining` error (an event in a
stream, a 503 otherwise) that tells the proxy to move them to another worker. A worker whose
engine thread died drains the same way and exits with status 1 (`ENGINE_DEAD_EXIT_CODE`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import uvicorn

from common.api.app import build_app
from common.api.cli import parse_args
from common.api.http_server import bounded_http
from common.cpu import CpuBudget, pin_process, set_torch_interop_threads
from common.engine.client import engine_factory

logger = logging.getLogger(__name__)


def apply_cpu_budget(budget: CpuBudget) -> None:
    """Pin the process now, while it has few threads; the engine thread sets its own threads."""
    if budget.cores is not None:
        pin_process(budget.cores)
    if not set_torch_interop_threads(budget.effective_threads):
        logger.info("torch's inter-op pool was already started; its size stays")
    logger.info("cpu budget: %s", budget.describe())


def main(role: str, argv: list[str] | None = None) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines go to stdout otherwise
    engine_cfg, server_cfg = parse_args(role, argv)
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    apply_cpu_budget(server_cfg.cpu)
    app = build_app(server_cfg, engine_factory(engine_cfg))
    config = uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.log_level,
        access_log=False,
        http=bounded_http(server_cfg.limits.max_header_bytes),
        timeout_graceful_shutdown=server_cfg.drain_timeout,
    )
    server = uvicorn.Server(config)

    def drain(sig, frame) -> None:
        # NOTE: uvicorn's own handler re-raises the signal after shutdown (exit status -15);
        # a drained worker exits 0. A second Ctrl-C still forces the exit.
        state = app.state.server
        state.is_draining = True
        if server_cfg.drain_migrate and state.loop is not None:  # NOTE: a signal handler: later
            state.loop.call_soon_threadsafe(state.migrate_all)
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    def stop() -> None:
        server.should_exit = True

    server.handle_exit = drain
    app.state.server.request_exit = stop
    server.run()
    if app.state.server.exit_code:
        sys.exit(app.state.server.exit_code)
