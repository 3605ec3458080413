"""Every error class a worker answers, in OpenAI's shape; 503 while starting; SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from common.api.app import build_app
from common.api.server_config import ServerConfig
from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.engine import LLMEngine
from tests.servers import free_port, wait_until
from tests.tiny_models import VOCAB


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert isinstance(err["code"], str) and err["code"], err  # a stable name for machines
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(
        "prefill",
        "--model",
        str(tiny_model("llama")),
        "--num-blocks",
        "64",
        "--max-model-len",
        "128",
        "--max-body-bytes",
        "4096",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
    )


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(prompt="hi", temperature=-1), "temperature"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=500), "max_tokens"),
        (dict(prompt="hi", n=0), "n"),
        (dict(prompt="hi", temperature="hot"), "temperature"),
        (dict(prompt="hi", prompt_logprobs=1), "prompt_logprobs"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[1, 2, VOCAB + 5]), "prompt"),
        (dict(prompt=[7] * 200), "prompt"),
        (dict(prompt="hi", stop_token_ids=[VOCAB]), "stop_token_ids"),
        (dict(prompt="hi", logprobs=50), "logprobs"),
    ],
)
def test_completions_400(server, body, param):
    assert_error(post(server, "/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), None),
        (dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "top_logprobs"),
        (dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=-1), None),
    ],
)
def test_chat_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", json=body), 400, param)


def test_bad_bodies(server):
    assert_error(post(server, "/v1/completions", content=b"{not json"), 400)
    assert_error(post(server, "/v1/completions", content=b'{"prompt": "\xff\xfe"}'), 400)
    assert_error(post(server, "/v1/completions", json=["prompt"]), 400)
    assert_error(post(server, "/v1/completions", json=dict(prompt="x" * 5000)), 413)
    assert_error(
        post(server, "/v1/completions", json=dict(prompt="hi", model="gpt-9")), 404, "model"
    )
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_429_past_max_waiting(start_server, tiny_model):
    # one batch slot and one waiting place; each request runs ~500 steps, so a burst overlaps
    server = start_server(
        "decode",
        "--model",
        str(tiny_model("llama")),
        "--num-blocks",
        "64",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
    )

    async def burst() -> list[httpx.Response]:
        body = dict(prompt="a b c", max_tokens=480, ignore_eos=True)
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(
                *[c.post(f"{server.url}/v1/completions", json=body) for _ in range(6)]
            )

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(429) >= 1, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert_error(rejected, 429)
    assert rejected.headers["retry-after"]
    assert all(
        r.json()["usage"]["completion_tokens"] == 480 for r in responses if r.status_code == 200
    )
    assert wait_until(lambda: server.metric("pdserve_kv_blocks_used") == 0)
    assert 'status="429"' in httpx.get(f"{server.url}/metrics").text


def test_503_while_starting(tiny_model):
    gate = threading.Event()
    # eager: a compile would only lengthen the start that the test waits out
    model = ModelConfig(str(tiny_model("llama")), enforce_eager=True)
    config = EngineConfig(model, CacheConfig(num_blocks=32))

    def slow_engine() -> LLMEngine:
        gate.wait(30)
        return LLMEngine(config)

    port = free_port()
    app = build_app(ServerConfig(role="decode", port=port), slow_engine)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _reachable(url))
        assert_error(httpx.get(f"{url}/health"), 503)
        r = httpx.post(f"{url}/v1/completions", json=dict(prompt="hi"))
        assert_error(r, 503)
        assert "starting" in r.json()["error"]["message"]
        gate.set()
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=60)
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


def _reachable(url: str) -> bool:
    try:
        httpx.get(f"{url}/metrics", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(r"^pdserve_num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1.0


def test_sigterm_drains_and_exits_zero(start_server, tiny_model):
    server = start_server(
        "decode", "--model", str(tiny_model("llama")), "--num-blocks", "64", "--drain-timeout", "20"
    )
    body = dict(prompt="drain me", max_tokens=60, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    events = [line for line in rest if line.startswith("data: {")]
    assert len(events) >= 50 and '"finish_reason":"length"' in events[-1]
    assert server.proc.wait(30) == 0


def test_sigterm_with_drain_migrate_ends_generations_at_once(start_server, tiny_model):
    """`--drain-migrate`: in-flight generations end now with a `worker_draining` error (the
    proxy's cue to move them), not after the drain timeout, and the process exits 0."""
    server = start_server(
        "decode",
        *("--model", str(tiny_model("llama")), "--num-blocks", "64"),
        *("--drain-timeout", "60", "--drain-migrate"),
    )
    body = dict(prompt="migrate me", max_tokens=500, ignore_eos=True, stream=True)
    whole: list[httpx.Response] = []
    url = f"{server.url}/v1/completions"
    waiter = threading.Thread(
        target=lambda: whole.append(httpx.post(url, json={**body, "stream": False}, timeout=60))
    )
    waiter.start()
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # tokens flow
        # both generations are running before the signal (else the late one is refused as a
        # request to a draining worker, which is another path)
        assert wait_until(lambda: _running(server.url) == 2, timeout=30)
        server.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: ")) == {
        "error": {
            "message": "the worker is draining: this generation moves elsewhere",
            "type": "worker_draining",
            "param": None,
            "code": "worker_draining",
            "status": 503,  # a worker's fault: the proxy moves it
        }
    }
    assert len(rest) < 400  # ended, not run to max_tokens
    waiter.join(10)
    assert assert_error(whole[0], 503)["type"] == "worker_draining"
    assert server.proc.wait(10) == 0
    assert time.monotonic() - started < 10
