"""A P that freezes with prefills in flight: once the health checks eject it, the proxy cuts
those prefills short and retries them on another P (or sends them to D alone), instead of
waiting out `--prefill-timeout` (300 s here). The workers are in-process stubs
(benchmarks/proxy_stubs.py) on loopback; the P that freezes takes its first prefill and never
answers it, and from then on never answers `/health` either."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import time

import httpx
import pytest
import uvicorn

from benchmarks.proxy_stubs import NUM_CHUNKS, make_app
from proxy.config import HealthConfig
from proxy.health import HealthChecker
from proxy.inflight import InFlight
from proxy.upstream import WorkerEjected
from proxy.workers import Worker
from tests.servers import free_port

HEALTH = ["--health-interval", "0.3", "--health-timeout", "0.3", "--health-failures", "1"]
WITHIN_S = 5.0  # ejection takes ~0.6 s; the prefill timeout is 300 s


class Stubs:
    """Bare ASGI stubs served from one event loop in a thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[uvicorn.Server] = []
        self.serving: list[concurrent.futures.Future] = []
        self.thawed = self._run(self._event())  # ends every hang at teardown

    async def _event(self) -> asyncio.Event:
        return asyncio.Event()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def serve(self, app) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.servers.append(server)
        self.serving.append(asyncio.run_coroutine_threadsafe(server.serve(), self.loop))
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "stub did not start"
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.thawed.set)
        for server in self.servers:
            server.should_exit = True
        concurrent.futures.wait(self.serving, timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class FreezingPrefill:
    """A prefill stub that freezes on its first prefill: that request and every later call,
    `/health` included, hang until the stubs close."""

    def __init__(self, thawed: asyncio.Event):
        self.app = make_app("prefill")
        self.thawed = thawed
        self.num_frozen = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (self.num_frozen or scope["method"] == "POST"):
            self.num_frozen += 1
            await self.thawed.wait()
            return
        await self.app(scope, receive, send)


class Decode:
    """The decode stub, with push-mode reservations: it records the ones released."""

    def __init__(self):
        self.app = make_app("decode")
        self.ids = itertools.count()
        self.released: list[str] = []

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/internal/kv/"):
            return await self.app(scope, receive, send)
        body = b""
        while (message := await receive()).get("more_body"):
            body += message.get("body", b"")
        body += message.get("body", b"")
        if path.endswith("/release"):
            self.released.append(json.loads(body)["reservation_id"])
            answer = b"{}"
        else:
            answer = json.dumps({"reservation_id": f"r{next(self.ids)}", "block_ids": [1]})
            answer = answer.encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def stubs():
    s = Stubs()
    yield s
    s.close()


def cluster(stubs: Stubs, start_server, num_healthy: int, *args: str):
    frozen = FreezingPrefill(stubs.thawed)
    decode = Decode()
    ps = [stubs.serve(frozen)] + [stubs.serve(make_app("prefill")) for _ in range(num_healthy)]
    proxy = start_server(
        "proxy", *[a for p in ps for a in ("--prefill", p)], "--decode", stubs.serve(decode),
        "--prefill-policy", "round_robin", "--prefill-timeout", "300", *HEALTH, *args,
    )  # fmt: skip
    return frozen, decode, proxy


def complete(proxy) -> float:
    """One completion through the proxy, checked whole; the seconds it took."""
    started = time.monotonic()
    body = {"prompt": "hi", "max_tokens": 16}
    r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " tok" * NUM_CHUNKS
    return time.monotonic() - started


def test_a_prefill_on_a_frozen_p_is_retried_on_another_once_it_is_ejected(stubs, start_server):
    frozen, _, proxy = cluster(stubs, start_server, 1)
    assert complete(proxy) < WITHIN_S  # round robin: the first prefill goes to the frozen P
    assert frozen.num_frozen >= 1
    assert proxy.metric('pdserve_proxy_retries_total{role="prefill"}') == 1
    assert proxy.metric('pdserve_proxy_upstream_errors_total{kind="ejected",role="prefill"}') == 1
    assert all(complete(proxy) < WITHIN_S for _ in range(3))  # the frozen P is out of routing
    assert proxy.metric('pdserve_proxy_routed_total{path="disaggregated",reason="pull"}') == 4


def test_with_a_single_p_frozen_the_request_goes_to_decode_alone(stubs, start_server):
    frozen, _, proxy = cluster(stubs, start_server, 0)
    assert complete(proxy) < WITHIN_S
    assert frozen.num_frozen >= 1
    fallback = 'pdserve_proxy_routed_total{path="colocated",reason="prefill_failed"}'
    assert proxy.metric(fallback) == 1
    assert complete(proxy) < WITHIN_S  # no routable P left


def test_push_releases_the_reservation_of_the_prefill_cut_short(stubs, start_server):
    frozen, decode, proxy = cluster(stubs, start_server, 1, "--mode", "push")
    assert complete(proxy) < WITHIN_S
    assert proxy.metric('pdserve_proxy_retries_total{role="prefill"}') == 1
    deadline = time.monotonic() + WITHIN_S
    while decode.released != ["r0"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.released == ["r0"]  # the frozen P's; r1 went to the P that answered


def test_in_flight_calls_end_on_ejection_and_a_cancel_is_not_an_ejection():
    async def scenario():
        worker = Worker("http://p:1", "prefill", None, None, True)  # type: ignore[arg-type]
        inflight = InFlight()
        never = asyncio.Event()
        ejected = asyncio.create_task(inflight.call(worker, never.wait()))
        cancelled = asyncio.create_task(inflight.call(worker, never.wait()))
        await asyncio.sleep(0)
        assert inflight.num_calls(worker) == 2
        cancelled.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        worker.eject("/health failed")
        inflight.cut(worker)
        with pytest.raises(WorkerEjected, match="ejected"):
            await asyncio.wait_for(ejected, 1)
        assert inflight.num_calls(worker) == 0
        with pytest.raises(WorkerEjected):  # ejected before the call started
            await inflight.call(worker, never.wait())
        worker.is_healthy = True
        assert await inflight.call(worker, asyncio.sleep(0, "answer")) == "answer"

    asyncio.run(scenario())


def test_health_checks_cut_a_worker_ejected_passively_too():
    async def scenario():
        client = httpx.AsyncClient(base_url="http://127.0.0.1:9")  # nothing listens there
        worker = Worker("http://127.0.0.1:9", "prefill", client, client._transport, True)
        cut: list[Worker] = []
        checker = HealthChecker(HealthConfig(failure_threshold=2), lambda: [worker], cut.append)
        worker.eject("connect refused")  # passive: no flip for the checks to report
        await checker.check(worker)
        assert cut == []  # one failure, below the threshold
        await checker.check(worker)
        await checker.check(worker)
        assert cut == [worker, worker]
        await client.aclose()

    asyncio.run(scenario())
