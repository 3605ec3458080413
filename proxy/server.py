"""Run the proxy: parse the command line, then either serve the app with uvicorn (uvloop when
installed, httptools), or, with `--workers N` above 1, start N such processes on one port
and supervise them (proxy/processes.py). The children get the command line without its
secrets, and the secrets in their environment."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from proxy.config import child_argv, parse_args, secrets_env, with_inherited_secrets
from proxy.processes import ProcessInfo, default_process_count, supervise


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    process = ProcessInfo.from_env()
    if process is not None:
        cfg = with_inherited_secrets(cfg, os.environ)
    tag = f"[{process.index}]" if process else ""
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"%(asctime)s %(levelname)s proxy{tag} %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call
    count = cfg.workers or default_process_count()
    if process is None:
        logging.getLogger(__name__).info(
            "proxy on http://%s:%d, mode %s, %d process(es): prefill %s, decode %s",
            cfg.host,
            cfg.port,
            cfg.mode,
            count,
            list(cfg.prefill),
            list(cfg.decode),
        )
        if count > 1:
            secrets = secrets_env(cfg)  # never on the children's command line
            sys.exit(supervise(child_argv(argv), secrets, cfg.host, cfg.port, count))
    from common.api.http_server import bounded_http  # NOTE: only where it serves, as the app
    from proxy.app import build_app  # NOTE: only where it serves: the supervisor stays light

    config = uvicorn.Config(
        build_app(cfg, process),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        loop="auto",
        http=bounded_http(cfg.limits.max_header_bytes),
        timeout_graceful_shutdown=cfg.drain_timeout,
    )
    uvicorn.Server(config).run(sockets=process.sockets() if process else None)
