"""Schemathesis against the live OpenAPI documents of a decode worker and of the proxy (in front of
a prefill and a decode worker): no request it makes, valid or not, gets a 5xx. The generation
routes declare their bodies (the protocol models' JSON schemas), so positive cases are
schema-valid requests, though few pass every semantic check and reach the engine (the cases of
tests/test_bad_input.py do). Bounded: 25 examples per operation; afterwards both pools are free.

NOTE: schemathesis.pytest.from_fixture fails under pytest 9.2 (it sets `_nodeid`), so each
operation is fuzzed through its Hypothesis strategy."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.servers import wait_until

TOKEN = "cluster-secret"
KEY = "sk-test"
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    # small contexts keep the generated requests cheap; reservations expire within seconds
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "512", "--max-model-len", "96"]
    common += ["--internal-token", TOKEN, "--served-model-name", "tiny", "--kv-lease-timeout", "2"]
    return start_server("prefill", *common), start_server("decode", *common)


@pytest.fixture(scope="module")
def proxy(start_server, workers):
    p, d = workers
    return start_server(
        "proxy", "--prefill", p.url, "--decode", d.url, "--internal-token", TOKEN,
        "--api-key", KEY,  # also the admin key: the admin routes are fuzzed too
    )  # fmt: skip


WORKER_ROUTES = [
    "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/completions/render",
    "POST /v1/chat/completions/render", "GET /v1/models", "GET /health",
    "GET /metrics", "GET /internal/kv/handshake", "POST /internal/kv/reserve",
    "POST /internal/kv/release", "GET /internal/kv/peers", "GET /internal/kv-events",
    "POST /internal/kv/lease",
]  # fmt: skip
PROXY_ROUTES = [
    "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
    "GET /ready", "GET /metrics", "GET /admin/workers", "POST /admin/workers",
    "POST /admin/workers/drain", "POST /admin/workers/remove",
]  # fmt: skip


@pytest.fixture(scope="module")
def schemas(workers, proxy):
    """The live OpenAPI documents: of the decode worker (P serves the same) and of the proxy."""
    return {
        "worker": schemathesis.openapi.from_url(f"{workers[1].url}/openapi.json"),
        "proxy": schemathesis.openapi.from_url(f"{proxy.url}/openapi.json"),
    }


def test_schemas_list_every_route_and_the_request_bodies(schemas):
    for name, routes in (("worker", WORKER_ROUTES), ("proxy", PROXY_ROUTES)):
        ops = {f"{op.method.upper()} {op.path}": op for op in _operations(schemas[name])}
        assert set(ops) == set(routes), name  # fuzzed below: nothing is left out
        body = ops["POST /v1/chat/completions"].definition.raw["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        # unknown top-level fields are ignored as vLLM does (common/api/ignored_fields.py)
        assert "messages" in schema["required"] and schema["additionalProperties"]


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize(
    "server, route", [("worker", r) for r in WORKER_ROUTES] + [("proxy", r) for r in PROXY_ROUTES]
)
def test_no_5xx(schemas, server, route):
    method, path = route.split()
    op = schemas[server][path][method]
    cases = st.one_of(
        op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)
    )

    @FUZZ
    @given(case=cases)
    def fuzz(case):
        headers = {"Authorization": f"Bearer {KEY}", "X-Internal-Token": TOKEN}
        case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=60)

    fuzz()


def test_pools_free_and_serving_after_fuzzing(workers, proxy):
    for worker in workers:
        assert wait_until(lambda w=worker: w.metric("pdserve_kv_blocks_used") == 0), worker.url
    body = {"prompt": "hello", "max_tokens": 4}
    r = httpx.post(
        f"{proxy.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
