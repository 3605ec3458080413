"""Run the proxy: parse the command line, build the app, serve it with uvicorn (uvloop and
httptools when installed)."""

from __future__ import annotations

import logging

import uvicorn

from proxy.app import build_app
from proxy.config import parse_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call
    logging.getLogger(__name__).info(
        "proxy on http://%s:%d, mode %s: prefill %s, decode %s",
        cfg.host,
        cfg.port,
        cfg.mode,
        list(cfg.prefill),
        list(cfg.decode),
    )
    uvicorn.run(
        build_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        loop="auto",
        http="auto",
        timeout_graceful_shutdown=10,
    )
