"""A worker whose engine thread dies fails closed: in-flight requests end with an error, new ones
get 503 in OpenAI's shape, and the process exits non-zero so that a supervisor restarts it."""

from __future__ import annotations

import contextlib

import httpx

from common.api.state import ENGINE_DEAD_EXIT_CODE
from tests.engine_fault import FaultyWorker
from tests.servers import wait_until


def assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "engine" in err["message"]


def test_a_dead_engine_fails_requests_and_exits_non_zero(tiny_model, tmp_path):
    args = ["--model", str(tiny_model("llama")), "--num-blocks", "64"]
    # the 4th step raises: mid-stream of the request
    server = FaultyWorker("prefill", args, tmp_path / "prefill.log", step=4)
    try:
        server.wait_ready()
        body = dict(prompt="hello there", max_tokens=64, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            text = r.read().decode()  # a hang would end in a ReadTimeout here
        assert r.status_code >= 500 or '"error"' in text, text
        assert_503(httpx.post(f"{server.url}/v1/completions", json=dict(prompt="hi"), timeout=10))
        with contextlib.suppress(httpx.ConnectError):  # unless the process is already gone
            assert_503(httpx.get(f"{server.url}/health", timeout=10))
        assert wait_until(lambda: server.proc.poll() is not None, timeout=60), server.log()
        assert server.proc.returncode == ENGINE_DEAD_EXIT_CODE, server.log()
        assert "engine died" in server.log()
    finally:
        server.stop()
