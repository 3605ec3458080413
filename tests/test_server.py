"""A live worker on loopback, driven by the official openai client and by raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.servers import wait_until

PROMPT = "def fibonacci(n):\n    return"
CHAT = [{"role": "user", "content": "import os and list the files"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(
        "decode", "--model", model_dir, "--num-blocks", "64", "--served-model-name", "tiny"
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, num_blocks=64, dtype="float32")  # as tests/servers.py runs workers


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_chat_streamed_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == whole.choices[0].message.content and text
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


def test_completions_streamed_and_not(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    parts = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"


def test_n_and_logprobs(client):
    out = client.completions.create(
        model="tiny",
        prompt=[PROMPT, "x = 1"],
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logprobs=2,
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, n=2, max_tokens=4, logprobs=True, top_logprobs=3, seed=1
    )
    assert len(chat.choices) == 2
    for c in chat.choices:
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in c.logprobs.content)


@pytest.mark.parametrize("extra", [dict(temperature=0), dict(temperature=0.8, seed=42, top_k=20)])
def test_server_equals_offline_engine(server, offline, extra):
    body = dict(
        model="tiny", prompt=PROMPT, max_tokens=16, ignore_eos=True, return_token_ids=True, **extra
    )
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    params = SamplingParams(max_tokens=16, ignore_eos=True, **extra)
    ref = offline.generate(PROMPT, params)[0]
    assert out["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    assert out["choices"][0]["prompt_token_ids"] == ref.prompt_token_ids
    assert out["choices"][0]["text"] == ref.outputs[0].text


def test_request_id_is_echoed(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers={"X-Request-Id": "req-42"},
        json=dict(prompt="a", max_tokens=1),
    )
    assert r.headers["x-request-id"] == "req-42" and r.json()["id"] == "cmpl-req-42"


def test_disconnect_mid_stream_frees_blocks(server):
    body = dict(prompt=PROMPT * 4, max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metric("pdserve_kv_blocks_used") > 0
    # the connection is closed: the server aborts the request and frees its blocks
    assert wait_until(lambda: server.metric("pdserve_num_requests_running") == 0)
    assert server.metric("pdserve_kv_blocks_used") == 0


def test_metrics_exposed(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pdserve_requests_total",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_e2e_request_latency_seconds_count",
        "pdserve_num_requests_waiting",
        "pdserve_num_requests_arriving",
        "pdserve_kv_blocks_free",
        "pdserve_prefix_cache_hit_rate",
    ):
        assert name in text, name
    assert 'status="200"' in text


def test_streamed_logprobs_cover_each_delta(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert len(entries) == 8 and all(len(t.top_logprobs) == 2 for t in entries)
