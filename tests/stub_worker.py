"""Stub decode workers that say who they are, for the proxy's discovery tests.

`python -m tests.stub_worker --port N --host 127.0.0.2 --host 127.0.0.3 ...` serves one bare
ASGI app on every HOST at the same PORT (one process, one uvicorn server per address). A
completion request streams `max_tokens` chunks whose text is the address that served it, one
every `--chunk-delay` seconds, then `[DONE]` (one JSON body when `stream` is false). `GET
/health` answers 200; `GET /stats` gives each address's `served` and `running` requests.
Idle keep-alive connections stay open (a long keep-alive timeout): only the proxy closes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import httpx
import uvicorn

from benchmarks.proxy_stubs import read_body
from deploy.processes import ServerProcess


def make_app(chunk_delay: float):
    served: Counter[str] = Counter()
    running: Counter[str] = Counter()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        host = scope["server"][0]
        if scope["method"] == "GET":
            stats = {h: {"served": served[h], "running": running[h]} for h in served}
            body = json.dumps(stats).encode() if scope["path"] == "/stats" else b'{"status":"ok"}'
            return await _send_json(send, body)
        request = json.loads(await read_body(receive) or b"{}")
        served[host] += 1
        running[host] += 1
        try:
            await _complete(send, host, request, chunk_delay)
        finally:
            running[host] -= 1

    return app


async def _complete(send, host: str, request: dict, chunk_delay: float) -> None:
    n = int(request.get("max_tokens") or 1)
    if not request.get("stream"):
        choice = {"index": 0, "text": f" {host}" * n, "finish_reason": "length"}
        return await _send_json(
            send, json.dumps({"object": "text_completion", "choices": [choice]})
        )
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" {host}"}]}
    for _ in range(n):
        await asyncio.sleep(chunk_delay)
        body = f"data: {json.dumps(chunk)}\n\n".encode()
        await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _send_json(send, body: bytes | str) -> None:
    body = body.encode() if isinstance(body, str) else body
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class StubWorkers(ServerProcess):
    """The stub process on `hosts` at one port; `wait_ready` waits for every address."""

    def __init__(self, hosts: list[str], port: int, log_path: Path, chunk_delay: float = 0.05):
        self.hosts = hosts
        self.chunk_delay = chunk_delay
        super().__init__("stub", [], log_path, port)
        self.url = self.url_of(hosts[0])

    def url_of(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        hosts = [a for h in self.hosts for a in ("--host", h)]
        cmd = [sys.executable, "-m", "tests.stub_worker", "--port", str(self.port), *hosts]
        return [*cmd, "--chunk-delay", str(self.chunk_delay)]

    def wait_ready(self, timeout: float = 60.0, path: str = "/health") -> StubWorkers:
        for host in self.hosts:
            self.url = self.url_of(host)
            super().wait_ready(timeout, path)
        self.url = self.url_of(self.hosts[0])
        return self

    def stats(self) -> dict[str, dict[str, int]]:
        return httpx.get(f"{self.url}/stats", timeout=5).json()

    def served(self, host: str) -> int:
        return self.stats().get(host, {}).get("served", 0)

    def running(self, host: str) -> int:
        return self.stats().get(host, {}).get("running", 0)


async def _serve(hosts: list[str], port: int, chunk_delay: float) -> None:
    app = make_app(chunk_delay)
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app,
                host=h,
                port=port,
                log_level="warning",
                timeout_keep_alive=600,
                lifespan="off",
                timeout_graceful_shutdown=1,  # a slow stream left open must not hold a teardown
            )
        )
        for h in hosts
    ]
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", action="append", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunk-delay", type=float, default=0.05)
    a = p.parse_args()
    asyncio.run(_serve(a.host, a.port, a.chunk_delay))


if __name__ == "__main__":
    main()
