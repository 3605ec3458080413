"""The proxy in front of a real prefill and a real decode worker (real NIXL over UCX): the openai
client through it gets exactly the colocated output in pull and push modes, with and without the
first token from P; conditional disaggregation, auth, request ids, errors, disconnects."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.servers import kv_sources, wait_until

TOKEN = "cluster-secret"
KEY = "sk-test"
P_COMPLETIONS = 'pdserve_requests_total{endpoint="/v1/completions",role="prefill",status="200"}'
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Write a haiku about the sea and the wind over it, please."}],
    [
        {"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "List three prime numbers and explain why each is prime " * 3},
    ],
]


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "256", "--max-model-len", "512"]
    common += ["--no-prefix-caching", "--internal-token", TOKEN, "--served-model-name", "tiny"]
    return start_server("prefill", *common), start_server("decode", *common)


@pytest.fixture(scope="module")
def start_proxy(start_server, workers):
    p, d = workers

    def start(*args: str):
        return start_server(
            "proxy", "--prefill", p.url, "--decode", d.url, "--internal-token", TOKEN,
            "--api-key", KEY, "--health-interval", "0.5", *args,
        )  # fmt: skip

    return start


@pytest.fixture(scope="module")
def proxy(start_proxy):
    return start_proxy()


def chat_stream(base_url: str, messages: list, key: str = KEY, **extra) -> dict:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    choices = [c.choices[0] for c in chunks if c.choices]
    return {
        "text": "".join(c.delta.content or "" for c in choices),
        "token_ids": [t for c in choices for t in (c.model_extra.get("token_ids") or [])],
        "finish": choices[-1].finish_reason,
        "usage": (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens),
    }


def assert_pools_free(*servers) -> None:
    for s in servers:
        assert wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0), pool_state(s)


def pool_state(server) -> str:
    """Where a worker's used blocks are, and the end of its log, for a failure's message."""
    names = ("used", "held", "in_transfer", "quarantined")
    state = {n: server.metric(f"pdserve_kv_blocks_{n}") for n in names}
    state["pushes_in_flight"] = server.metric("pdserve_kv_pushes_in_flight")
    state["running"] = server.metric("pdserve_num_requests_running")
    return f"{server.url}: {state}\n--- the end of its log ---\n{server.log()}"


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("first_from_p", [True, False])
def test_openai_client_through_proxy_equals_colocated(start_proxy, workers, mode, first_from_p):
    p, d = workers
    flags = [] if first_from_p else ["--no-first-token-from-prefill"]
    proxy = start_proxy("--mode", mode, *flags)
    before = kv_sources(d)
    for messages in CHATS:
        colocated = chat_stream(d.url, messages)
        through = chat_stream(proxy.url, messages)
        assert through == colocated
        assert through["usage"][1] == 10 and len(through["token_ids"]) == 10
    body = dict(prompt=list(range(3, 60)), max_tokens=8, temperature=0.8, seed=5)
    body.update(return_token_ids=True, ignore_eos=True)
    whole = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=auth(), timeout=60)
    assert whole.status_code == 200, whole.text
    local = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()
    assert whole.json()["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    routed = f'pdserve_proxy_routed_total{{path="disaggregated",reason="{mode}"}}'
    assert proxy.metric(routed) == len(CHATS) + 1
    # D decoded every one of them from the transferred KV: none was recomputed
    assert wait_until(lambda: kv_sources(d)[mode] - before[mode] == len(CHATS) + 1)
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    if mode == "pull":  # D read the KV; in push mode P wrote it
        assert d.metric("pdserve_kv_transfers_total") > 0
    else:
        assert p.metric("pdserve_kv_push_bytes_total") > 0
    assert_pools_free(p, d)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_is_required(proxy):
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, auth("wrong")):
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        chat_stream(proxy.url, CHATS[0], key="wrong")
    assert httpx.get(f"{proxy.url}/health").status_code == 200  # no key for probes
    assert httpx.post(f"{proxy.url}/v1/completions", json=body, headers=auth()).status_code == 200


def test_short_prompts_go_to_decode_alone(start_proxy, workers):
    p, d = workers
    proxy = start_proxy("--min-disagg-tokens", "40")
    prefilled = p.metric(P_COMPLETIONS, 0)
    short = {"prompt": list(range(3, 20)), "max_tokens": 4, "temperature": 0}
    long = {**short, "prompt": list(range(3, 80))}
    for body in (short, long):
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
    assert proxy.metric('pdserve_proxy_routed_total{path="colocated",reason="short_prompt"}') == 1
    assert proxy.metric('pdserve_proxy_routed_total{path="disaggregated",reason="pull"}') == 1
    after = p.metric(P_COMPLETIONS)
    assert after == prefilled + 1  # only the long prompt was prefilled on P


def test_request_id_reaches_workers_and_client(proxy):
    body = {"prompt": "hello there", "max_tokens": 3}
    headers = {**auth(), "X-Request-Id": "req-42"}
    r = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.headers["x-request-id"] == "req-42"
    assert r.json()["id"] == "cmpl-req-42"  # D's response id is made from the same request id
    generated = httpx.post(f"{proxy.url}/v1/completions", json=body, headers=auth(), timeout=60)
    assert len(generated.headers["x-request-id"]) == 32


def test_client_errors_pass_through_in_openai_shape(proxy):
    url = f"{proxy.url}/v1/completions"
    bad = httpx.post(url, json={"prompt": "x", "temperature": -1}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    cases = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"prompt": "x", "kv_transfer_params": {}}).encode(), 400),
        (b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413),
    ]
    for content, status in cases:
        r = httpx.post(url, content=content, headers={**auth(), "content-type": "application/json"})
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_client_disconnect_mid_stream_frees_both_pools(proxy, workers):
    p, d = workers
    body = {"prompt": list(range(3, 40)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, headers=auth()) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # NOTE: P's token, sent before D is reached
        assert wait_until(lambda: d.metric("pdserve_num_requests_running") == 1)
    assert wait_until(lambda: proxy.metric("pdserve_proxy_client_disconnects_total") >= 1)
    assert wait_until(lambda: d.metric("pdserve_num_requests_running") == 0)
    assert_pools_free(p, d)


def test_internal_routes_need_the_cluster_token(workers):
    p, d = workers
    assert httpx.get(f"{p.url}/internal/kv/handshake").status_code == 401
    ok = httpx.get(f"{p.url}/internal/kv/handshake", headers={"X-Internal-Token": TOKEN})
    assert ok.status_code == 200
    r = httpx.post(f"{d.url}/internal/kv/reserve", json={"num_tokens": 16})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_admin_routes(proxy, workers):
    url = f"{proxy.url}/admin/workers"
    assert httpx.get(url).status_code == 401
    bogus = "http://127.0.0.1:9"
    added = httpx.post(url, json={"role": "decode", "url": bogus}, headers=auth())
    assert added.status_code == 200 and added.json()["healthy"] is False
    listed = httpx.get(url, headers=auth()).json()["workers"]
    assert {w["url"] for w in listed} == {workers[0].url, workers[1].url, bogus}
    drained = httpx.post(f"{url}/drain", json={"url": bogus}, headers=auth())
    assert drained.json()["draining"] is True
    removed = httpx.post(f"{url}/remove", json={"url": bogus}, headers=auth())
    assert removed.json()["removed"] is True
    assert httpx.post(f"{url}/remove", json={"url": bogus}, headers=auth()).status_code == 404
    assert httpx.get(f"{proxy.url}/ready").json()["ready"] is True
