"""The trust boundaries of docs/security.md: the proxy's API key, the admin key, the workers'
cluster token on their internal routes, and the bind address. (tests/test_proxy.py covers the
basics: a missing or wrong key on /v1/completions, the handshake without the token.)"""

from __future__ import annotations

import socket

import httpx
import pytest

TOKEN = "cluster-secret"
KEY, ADMIN_KEY = "sk-client", "sk-admin"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [  # (method, path, body) of the OpenAI surface
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
]
ADMIN_ROUTES = [
    ("GET", "/admin/workers", None),
    ("POST", "/admin/workers", {"role": "decode", "url": "http://127.0.0.1:9"}),
    ("POST", "/admin/workers/drain", {"url": "http://127.0.0.1:9"}),
    ("POST", "/admin/workers/remove", {"url": "http://127.0.0.1:9"}),
]


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "128", "--max-model-len", "256"]
    common += ["--internal-token", TOKEN, "--served-model-name", "tiny"]
    p, d = start_server("prefill", *common, wait=False), start_server("decode", *common, wait=False)
    return p.wait_ready(), d.wait_ready()  # started side by side


@pytest.fixture(scope="module")
def start_proxy(start_server, workers):
    p, d = workers
    return lambda *args: start_server("proxy", "--prefill", p.url, "--decode", d.url, *args)


@pytest.fixture(scope="module")
def proxy(start_proxy):
    return start_proxy("--api-key", KEY, "--admin-key", ADMIN_KEY, "--internal-token", TOKEN)


def call(url: str, method: str, path: str, body: dict | None, headers: dict | None = None):
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, error_type: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == error_type


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_api_key_guards_the_openai_routes(proxy, method, path, body):
    refused = [{}, bearer("wrong"), bearer(ADMIN_KEY), {"Authorization": f"Basic {KEY}"}]
    for headers in refused:
        assert_error(call(proxy.url, method, path, body, headers), 401, "authentication_error")
    for headers in (bearer(KEY), {"Authorization": f"bearer  {KEY}"}):
        assert call(proxy.url, method, path, body, headers).status_code == 200


def test_probes_need_no_key(proxy):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{proxy.url}{path}").status_code == 200, path


@pytest.fixture(scope="module")
def open_proxy(start_proxy):
    return start_proxy()  # no keys at all


@pytest.mark.parametrize("method, path, body", ADMIN_ROUTES)
def test_admin_routes_need_the_admin_key(open_proxy, proxy, method, path, body):
    # no admin key configured: the admin routes are off, whatever a client sends
    assert_error(call(open_proxy.url, method, path, body, bearer(KEY)), 403, "permission_error")
    for headers in ({}, bearer(KEY), bearer("wrong")):
        assert_error(call(proxy.url, method, path, body, headers), 401, "authentication_error")


def test_admin_refuses_malformed_worker_urls(proxy):
    for url in ("ftp://x", "http://[::1", "http://a b", "http://" + "a" * 64 + ".com", "http://"):
        body = {"role": "decode", "url": url}
        r = call(proxy.url, "POST", "/admin/workers", body, bearer(ADMIN_KEY))
        assert_error(r, 400, "invalid_request_error")
    listed = call(proxy.url, "GET", "/admin/workers", None, bearer(ADMIN_KEY)).json()["workers"]
    assert len(listed) == 2


def test_internal_routes_need_the_cluster_token(workers):
    _, d = workers
    routes = [("GET", "/internal/kv/handshake", None), ("POST", "/internal/kv/reserve", {})]
    routes += [("POST", "/internal/kv/release", {"request_id": "r"})]
    routes += [("GET", "/internal/kv/peers", None), ("POST", "/internal/kv/lease", {})]
    for method, path, body in routes:
        for headers in ({}, {"X-Internal-Token": "wrong"}, {"X-Internal-Token": TOKEN.upper()}):
            assert_error(call(d.url, method, path, body, headers), 401, "authentication_error")
    ok = {"X-Internal-Token": TOKEN}
    assert call(d.url, "GET", "/internal/kv/handshake", None, ok).json()["agent_metadata"]
    reserved = call(d.url, "POST", "/internal/kv/reserve", {"num_tokens": 20}, ok)
    assert reserved.status_code == 200, reserved.text
    release = {"reservation_id": reserved.json()["reservation_id"]}
    assert call(d.url, "POST", "/internal/kv/release", release, ok).json() == {"released": True}
    nothing = call(d.url, "POST", "/internal/kv/lease", {"token_ids": [5, 6, 7]}, ok)
    assert nothing.json() == {"kv_transfer_params": None, "num_tokens": 0}  # none cached


def test_kv_transfer_params_need_the_cluster_token(workers):
    """They make the worker call the peer they name with the token attached: without the token a
    client could point a worker at its own host and collect it."""
    p, d = workers
    trap = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0],
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 9}  # fmt: skip
    body = {"prompt": "hi", "max_tokens": 2}
    for url, params in ((d.url, trap), (p.url, {"do_remote_decode": True})):
        r = httpx.post(f"{url}/v1/completions", json={**body, "kv_transfer_params": params})
        assert_error(r, 401, "authentication_error")
    ok = httpx.post(f"{p.url}/v1/completions", headers={"X-Internal-Token": TOKEN},
                    json={**body, "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["kv_transfer_params"]["remote_block_ids"]
    release = {"request_id": ok.json()["kv_transfer_params"]["remote_request_id"]}
    call(p.url, "POST", "/internal/kv/release", release, {"X-Internal-Token": TOKEN})


def test_push_needs_the_proxys_token_too(start_proxy, workers):
    """With the token, P writes the KV into blocks D reserved for the proxy; with a wrong one D
    refuses the reservation and P the prefill for a transfer, so the request is served by D
    alone (the client is not blamed)."""
    p, d = workers
    for token, pushed in ((TOKEN, True), ("wrong", False)):
        proxy = start_proxy("--mode", "push", "--internal-token", token)
        before = p.metric("pdserve_kv_push_bytes_total", 0), d.metric("pdserve_kv_transfers_total")
        r = call(proxy.url, "POST", "/v1/chat/completions", CHAT)
        assert r.status_code == 200, r.text
        after = p.metric("pdserve_kv_push_bytes_total", 0), d.metric("pdserve_kv_transfers_total")
        assert (after[0] > before[0], after[1] > before[1]) == (pushed, False)
    colocated = 'pdserve_proxy_routed_total{path="colocated",reason="prefill_failed"}'
    assert proxy.metric(colocated) == 1


NON_ASCII = b"\xff\xfe\xc3\xa9"  # raw header bytes: latin-1 to the server, not ASCII


def test_non_ascii_credentials_are_refused_not_a_server_error(proxy, workers):
    """A header's value may hold any byte: a credential that is not ASCII is a wrong one (401),
    not a 500 from comparing it."""
    p, d = workers
    client, token = {"Authorization": b"Bearer " + NON_ASCII}, {"X-Internal-Token": NON_ASCII}
    generate = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    refused = [
        (proxy.url, "GET", "/v1/models", None, client),
        (proxy.url, "GET", "/admin/workers", None, client),
        (d.url, "GET", "/internal/kv/peers", None, token),
        (p.url, "POST", "/internal/kv/release", {"request_id": "r"}, token),
        (p.url, "POST", "/v1/completions", generate, token),
    ]
    for url, method, path, body, headers in refused:
        assert_error(call(url, method, path, body, headers), 401, "authentication_error")
    for path in ("/health", "/ready", "/metrics"):  # open: the header is no credential there
        r = httpx.get(f"{proxy.url}{path}", headers=client)
        assert r.status_code == 200, path


def other_local_address() -> str:
    """An address of this machine other than 127.0.0.1: the outgoing interface's, else
    127.0.0.2 (Linux routes all of 127/8 over lo)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: nothing is sent; the kernel picks a source address
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    return "127.0.0.2" if address.startswith("127.") else address


def is_reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_servers_bind_only_the_host_given(start_server, start_proxy, proxy, workers, tiny_model):
    other = other_local_address()
    for server in (proxy, *workers):  # --host 127.0.0.1, the default
        assert is_reachable("127.0.0.1", server.port)
        assert not is_reachable(other, server.port), f"{server.url} answers on {other}"
    model = ["--model", str(tiny_model("llama")), "--num-blocks", "32", "--kv-connector", "none"]
    everywhere = ["--host", "0.0.0.0"]
    for server in (start_server("decode", *model, *everywhere), start_proxy(*everywhere)):
        assert is_reachable(other, server.port)
        assert httpx.get(f"http://{other}:{server.port}/health").status_code == 200
