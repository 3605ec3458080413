"""Whose fault an error is, in-process: the typed error a worker writes (OpenAI's shape, a string
`code`, and in a stream the `status` it would have had), how the proxy reads it (a 4xx is the
request's: final, but for a token mismatch, a full or timed-out worker; anything else the
worker's, and an older worker's untyped event too), and the
same rule for a worker's answer with an error status. tests/test_migration.py proves the wiring
through real processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from common.api.errors import (
    APIError,
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    ServerError,
    UnavailableError,
    WorkerDrainingError,
    fault_of,
)
from common.engine.output import RequestOutput
from proxy.journey.client import ClientStream
from proxy.journey.migration import Migration
from proxy.journey.relay import Relay
from proxy.metrics import ProxyMetrics
from proxy.request import COMPLETIONS_PATH, ProxyRequest
from proxy.sse import error_event, passed_on_event
from proxy.upstream import UpstreamError

WORKER = SimpleNamespace(url="http://127.0.0.1:1", role="decode")  # what an error names
ERRORS = [
    InvalidRequestError("bad"),
    AuthenticationError("who"),
    NotFoundError("where"),
    PayloadTooLargeError("big"),
    OverloadedError("full"),
    UnavailableError("down"),
    WorkerDrainingError(),
    ServerError("bug"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_has_a_string_code_and_in_a_stream_its_status(error: APIError):
    body = error.to_response().model_dump()["error"]
    assert set(body) == {"message", "type", "param", "code"}  # OpenAI's four, in a body
    assert isinstance(body["code"], str) and body["code"]
    event = error.to_event().model_dump()["error"]
    assert event == {**body, "status": int(error.status_code)}
    is_workers = error.status_code >= 500 or error.status_code in (401, 403, 408, 429)
    assert fault_of(event) == ("worker" if is_workers else "request")


def test_a_raise_names_a_finer_code_and_a_class_without_one_gives_its_type():
    assert InvalidRequestError("x", code="grammar_violation").code == "grammar_violation"
    assert WorkerDrainingError().to_event().error.code == "worker_draining"

    class Forbidden(APIError):
        status_code = 403
        error_type = "permission_error"

    assert Forbidden("no").code == "permission_error"


@pytest.mark.parametrize(
    "error, fault",
    [
        ({"message": "m", "type": "invalid_request_error", "code": "x", "status": 400}, "request"),
        ({"message": "m", "type": "invalid_request_error", "code": "x", "status": 422},
         "request"),
        # a worker full (429) or one that refuses the proxy's token (401): the worker's
        ({"message": "m", "type": "rate_limit_error", "code": "x", "status": 429}, "worker"),
        ({"message": "m", "type": "authentication_error", "code": "x", "status": 401},
         "worker"),
        ({"message": "m", "type": "server_error", "code": "x", "status": 500}, "worker"),
        ({"message": "m", "type": "worker_draining", "code": "worker_draining", "status": 503},
         "worker"),
        # an older worker: untyped (code null, no status), whatever its type says: as before
        ({"message": "m", "type": "invalid_request_error", "param": None, "code": None},
         "worker"),
        ({"message": "m", "type": "worker_draining", "code": 503}, "worker"),
        # the proxy's own events before `status`: the status in `code`
        ({"message": "m", "type": "server_error", "code": 400}, "request"),
        ({"message": "m", "type": "server_error", "code": 502}, "worker"),
        ("not an object", "worker"),
    ],
)  # fmt: skip
def test_fault_of_an_error_event(error, fault):
    assert fault_of(error) == fault


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_a_workers_4xx_answer_is_the_requests_fault(status):
    e = UpstreamError(WORKER, "refused", status, b"{}")
    assert e.is_client_error and e.fault == "request"


# a token mismatch (401, 403), a full worker (429) or its timeout (408): another may serve it
@pytest.mark.parametrize("status", [401, 403, 408, 429, 500, 502, 503, 504, None])
def test_a_workers_5xx_or_no_answer_is_the_workers_fault(status):
    e = UpstreamError(WORKER, "failed", status)
    assert not e.is_client_error and e.fault == "worker"


def _payload(event: bytes) -> dict:
    first = event.split(b"\n\n")[0]
    return json.loads(first.removeprefix(b"data: "))["error"]


def test_the_proxys_own_events_are_typed_and_a_workers_error_passes_on_with_its_status():
    assert _payload(error_event("gone", code="decode_failed")) == {
        "message": "gone", "type": "server_error", "param": None, "code": "decode_failed",
        "status": 502,
    }  # fmt: skip
    worker = {"message": "no", "type": "invalid_request_error", "param": "n", "code": "x"}
    assert _payload(passed_on_event(worker, 400)) == {**worker, "status": 400}


def test_an_engine_error_names_its_fault():
    head = ("r", None, [1], [], True)
    grammar = RequestOutput(*head, error="off the grammar", error_is_request_fault=True)
    assert grammar.error_code == "grammar_violation"
    assert RequestOutput(*head, error="the KV was lost").error_code == "kv_transfer_failed"
    assert RequestOutput(*head).error_code is None


def _relay() -> Relay:
    body = {"prompt": "hi", "stream": True}
    req = ProxyRequest(COMPLETIONS_PATH, body, json.dumps(body).encode(), "r1")
    client, metrics = ClientStream(req), ProxyMetrics({})
    planner = SimpleNamespace(cfg=SimpleNamespace(migration_limit=3))
    migration = Migration(req, client, planner, None, None, None, metrics)
    return Relay(req, client, migration, None, None, None, None, metrics)


@pytest.mark.parametrize(
    "error, failure",
    [
        ({"message": "m", "type": "invalid_request_error", "code": "grammar_violation",
          "status": 400}, "request_fault"),
        ({"message": "m", "type": "server_error", "code": "kv_transfer_failed", "status": 500},
         "error_event"),
        ({"message": "m", "type": "worker_draining", "code": "worker_draining", "status": 503},
         "drain"),
        ({"message": "m", "type": "invalid_request_error", "param": None, "code": None},
         "error_event"),  # an older worker's untyped event moves, as it always did
    ],
)  # fmt: skip
def test_a_decode_streams_error_event_is_final_only_when_it_is_the_requests_fault(error, failure):
    relay = _relay()
    raw = b"data: " + json.dumps({"error": error}).encode()
    sent, why = relay._event(raw)
    assert why == failure
    assert (sent == raw + b"\n\n") if failure == "request_fault" else sent is None
    fault = "request" if failure == "request_fault" else "worker"
    counted = relay.metrics.registry.get_sample_value(
        "pdserve_proxy_upstream_faults_total", {"role": "decode", "fault": fault}
    )
    assert counted == 1
