"""Nothing leaks when clients leave early: after 200 clients that send a streamed request and
hang up before reading it, both KV pools are free and the proxy counts no outstanding request;
200 requests to random unknown paths leave the workers' request metric with a bounded label set.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid

import httpx
import pytest

from proxy.sse import EventStreamResponse
from tests.servers import wait_until
from tests.test_proxy import KEY, TOKEN, assert_pools_free

NUM_CLIENTS = 200


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "512", "--max-model-len", "256"]
    common += ["--no-prefix-caching", "--internal-token", TOKEN, "--served-model-name", "tiny"]
    # leases and reservations outlive the test: only an explicit release frees them in time
    common += ["--kv-lease-timeout", "300"]
    return start_server("prefill", *common), start_server("decode", *common)


def start_proxy(start_server, workers, *args: str):
    p, d = workers
    return start_server(
        "proxy", "--prefill", p.url, "--decode", d.url, "--internal-token", TOKEN,
        "--api-key", KEY, "--health-interval", "0.5", *args,
    )  # fmt: skip


def send_and_hang_up(url: str, body: dict, wait_s: float) -> None:
    """POST a streamed request on a raw socket and close it `wait_s` later, unread."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head.encode() + payload)
        time.sleep(wait_s)


def outstanding(proxy) -> list[int]:
    ready = httpx.get(f"{proxy.url}/ready", timeout=5).json()
    return [w["outstanding"] for w in ready["workers"]]


# NOTE: in the whole suite on a 2-core AVX2 box (beside two other test workers) P kept ~85 of
# the 200 hung-up requests' leases (held, until --kv-lease-timeout) on 2026-12-07; alone, and
# beside three CPU spinners or two other modules, it leaks nothing. The race is not found yet
# (issue note of that day): the test runs alone, after the rest, until it is.
@pytest.mark.serial
@pytest.mark.parametrize(
    "mode,first_from_p",
    [("pull", False), ("push", True), ("push", False)],
)
def test_clients_that_hang_up_early_leak_nothing(start_server, workers, mode, first_from_p):
    p, d = workers
    flags = [] if first_from_p else ["--no-first-token-from-prefill"]
    proxy = start_proxy(start_server, workers, "--mode", mode, *flags)
    body = {"prompt": list(range(3, 60)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    for i in range(NUM_CLIENTS):  # hang up at different moments: before P, during P, after P
        send_and_hang_up(proxy.url, body, wait_s=(i % 20) * 0.002)
    assert wait_until(lambda: outstanding(proxy) == [0, 0], timeout=30), outstanding(proxy)
    assert wait_until(lambda: d.metric("pdserve_num_requests_running") == 0, timeout=30)
    assert_pools_free(p, d)
    # P keeps no book of pushes aborted before their first token
    assert wait_until(lambda: p.metric("pdserve_kv_pushes_in_flight") == 0, timeout=30)


def test_unknown_paths_do_not_grow_the_request_metric(workers):
    p, _ = workers
    for _ in range(NUM_CLIENTS):
        r = httpx.get(f"{p.url}/v1/{uuid.uuid4().hex}")
        assert r.status_code == 404
    text = httpx.get(f"{p.url}/metrics").text
    endpoints = set(re.findall(r'^pdserve_requests_total\{[^}]*endpoint="([^"]*)"', text, re.M))
    assert len(endpoints) <= 5, sorted(endpoints)


def test_event_stream_runs_the_generators_finally_when_the_client_left_before_it_began():
    freed = []

    async def chunks():
        try:
            yield b"data: 1\n\n"
        finally:  # where the orchestrator closes D's stream and lowers its outstanding count
            freed.append(True)

    async def send(message):
        if message["type"] == "http.response.start":  # as uvicorn drains a paused transport
            await asyncio.sleep(0.01)

    async def receive():
        return {"type": "http.disconnect"}

    asyncio.run(EventStreamResponse(chunks())({"type": "http"}, receive, send))
    assert freed == [True]
