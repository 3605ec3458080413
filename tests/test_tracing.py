"""OpenTelemetry traces (`--otlp-traces-endpoint`, docs/observability.md, "Traces"): one
trace per request across the proxy, P and D, with the right parents and durations that add up
to what the client measured; W3C trace context kept from the client and across every hop; a worker
called without one starts its own trace; and with the flag absent OpenTelemetry is not even
imported.

The real-process tests send their spans over OTLP/HTTP to a small receiver in this process,
which decodes the protobuf bodies as a collector would."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from tests.servers import ROOT, free_port, wait_until

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks to move


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces with a protobuf
    `ExportTraceServiceRequest`; its spans kept as dicts."""

    def __init__(self):
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 — http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                ok = self.path == "/v1/traces"
                if ok:
                    receiver._take(body)
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        dict(
                            name=s.name,
                            service=resource["service.name"],
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex() or None,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            events={e.name: _attributes(e.attributes) for e in s.events},
                        )
                    )
        with self._lock:
            self.spans += spans

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(pairs) -> dict:
    out = {}
    for kv in pairs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cluster(start_server, tiny_model, receiver):
    """P, D and two proxies (pull, push), each exporting to `receiver` every 100 ms."""
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms between the batch exporter's sends
    try:
        traced = ["--otlp-traces-endpoint", receiver.url]
        common = ["--model", str(tiny_model("llama")), "--num-blocks", "64"]
        common += ["--max-model-len", "256", "--no-prefix-caching", *traced]
        p = start_server("prefill", *common, wait=False)
        d = start_server("decode", *common, wait=False)
        p, d = p.wait_ready(), d.wait_ready()
        proxies = {
            mode: start_server(
                "proxy",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--mode",
                mode,
                "--no-first-token-from-prefill",
                *traced,
                wait=False,
            )  # fmt: skip
            for mode in ("pull", "push")
        }
        for proxy in proxies.values():
            proxy.wait_ready(path="/ready")
        return p, d, proxies
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def stream_ttft(url: str, headers: dict) -> float:
    """Send one streamed completion; seconds until its first token arrived."""
    body = dict(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0, stream=True)
    client = httpx.Client(timeout=60)  # NOTE: made before the clock starts (~20 ms of TLS set-up)
    started = time.perf_counter()
    ttft = None
    with client, client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                assert json.loads(line[6:])["choices"][0]["text"] is not None
                ttft = time.perf_counter() - started
    assert ttft is not None
    return ttft


NAMES = {
    "pdserve-proxy": {"proxy.request", "proxy.queue", "proxy.route", "proxy.prefill"},
    "pdserve-prefill": {"prefill.request", "admission", "queue", "prefill"},
    "pdserve-decode": {"decode.request", "admission", "queue", "first_step", "decode"},
}


def wait_for_trace(receiver: OtlpReceiver, trace_id: str, names: dict) -> dict[tuple, dict]:
    """The trace's spans by (service, name), once every one of `names` has arrived."""

    def by_name() -> dict[tuple, dict]:
        return {(s["service"], s["name"]): s for s in receiver.trace(trace_id)}

    def complete() -> bool:
        have = by_name()
        return all((service, n) in have for service, ns in names.items() for n in ns)

    assert wait_until(complete, timeout=15), sorted(by_name())
    return by_name()


def ms(span: dict) -> float:
    return (span["end"] - span["start"]) / 1e6


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_one_trace_holds_the_proxy_p_transfer_and_d(cluster, receiver, mode):
    p, d, proxies = cluster
    traceparent, trace_id, client_span = new_traceparent()
    ttft = stream_ttft(proxies[mode].url, {"traceparent": traceparent})
    transfer = ("pdserve-decode", "kv.read") if mode == "pull" else ("pdserve-prefill", "kv.write")
    # the module's first request of each mode meets its peer: D meets P to read, P meets D to
    # write
    handshake = ("pdserve-decode" if mode == "pull" else "pdserve-prefill", "kv.handshake")
    names = {k: set(v) for k, v in NAMES.items()}
    names["pdserve-proxy"] |= {"proxy.decode"} | ({"proxy.reserve"} if mode == "push" else set())
    for service, name in (transfer, handshake):
        names[service].add(name)
    spans = wait_for_trace(receiver, trace_id, names)

    root = spans["pdserve-proxy", "proxy.request"]
    assert root["parent_id"] == client_span  # the client's traceparent is kept
    attrs = root["attributes"]
    assert attrs["pdserve.mode"] == mode and attrs["pdserve.path"] == "disaggregated"
    assert attrs["pdserve.prefill_url"] == p.url and attrs["pdserve.decode_url"] == d.url
    assert attrs["http.status_code"] == 200
    for name in ("proxy.queue", "proxy.route", "proxy.prefill", "proxy.decode"):
        assert spans["pdserve-proxy", name]["parent_id"] == root["span_id"], name
    p_call, d_call = spans["pdserve-proxy", "proxy.prefill"], spans["pdserve-proxy", "proxy.decode"]
    p_root = spans["pdserve-prefill", "prefill.request"]
    d_root = spans["pdserve-decode", "decode.request"]
    # each worker's request is a child of the proxy's call to it (traceparent injected)
    assert p_root["parent_id"] == p_call["span_id"]
    assert d_root["parent_id"] == d_call["span_id"]
    for name in ("admission", "queue", "prefill"):
        assert spans["pdserve-prefill", name]["parent_id"] == p_root["span_id"], name
    for name in ("admission", "queue", "first_step", "decode"):
        assert spans["pdserve-decode", name]["parent_id"] == d_root["span_id"], name
    moved = spans[transfer]
    assert moved["parent_id"] == (p_root if mode == "push" else d_root)["span_id"]
    # the handshake is part of its worker's admission, and a span of its own there
    met = spans[handshake]
    admission = spans[handshake[0], "admission"]
    assert met["parent_id"] == admission["parent_id"]
    assert admission["start"] <= met["start"] <= met["end"] <= admission["end"]
    if mode == "push":
        assert ("pdserve-decode", "kv.read") not in spans  # D read nothing: P wrote it
    else:
        assert ("pdserve-prefill", "kv.write") not in spans
        assert p_root["events"]["kv.lease"]["pdserve.num_blocks"] == 3  # 40 tokens, blocks of 16
        # D's first step loads the KV: the read lies inside it
        first = spans["pdserve-decode", "first_step"]
        assert first["start"] <= moved["start"] <= moved["end"] <= first["end"]
    # nested in time: each worker's request inside the proxy's call to it
    assert p_call["start"] <= p_root["start"] <= p_root["end"] <= p_call["end"]
    assert d_call["start"] <= d_root["start"]
    # what the client waited for its first token, span by span: the proxy's queue and routing,
    # the reservation on D (push), P's call, D's admission (in pull its first request from this
    # P shakes hands) and first step (the proxy waits for D's stream: no first token from P)
    reserve = spans.get(("pdserve-proxy", "proxy.reserve"))
    assert (reserve is not None) == (mode == "push")
    parts = (
        ms(spans["pdserve-proxy", "proxy.queue"])
        + ms(spans["pdserve-proxy", "proxy.route"])
        + (ms(reserve) if reserve else 0.0)
        + ms(p_call)
        + ms(spans["pdserve-decode", "admission"])
        + ms(spans["pdserve-decode", "first_step"])
    )
    timeline = [
        (k, round((s["start"] - root["start"]) / 1e6, 1), round(ms(s), 1))
        for k, s in sorted(spans.items(), key=lambda kv: kv[1]["start"])
    ]
    assert abs(parts - ttft * 1e3) <= max(50.0, 0.3 * ttft * 1e3), (parts, ttft * 1e3, timeline)


def test_vllm_router_passes_the_trace_on_to_both_workers(cluster, receiver, tmp_path):
    """vllm-router (its P/D mode) has no spans of its own but passes the client's `traceparent`
    on: P's and D's request spans are children of the client's span, in the client's trace."""
    from tests.test_interop import run_router

    p, d, _ = cluster
    args = ["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]
    traceparent, trace_id, client_span = new_traceparent()
    with run_router([*args, "--policy", "round_robin"], tmp_path / "router.log") as (url, _):
        stream_ttft(url, {"traceparent": traceparent})
    names = {
        "pdserve-prefill": {"prefill.request", "prefill"},
        "pdserve-decode": {"decode.request", "first_step", "kv.read"},
    }
    spans = wait_for_trace(receiver, trace_id, names)
    assert spans["pdserve-prefill", "prefill.request"]["parent_id"] == client_span
    assert spans["pdserve-decode", "decode.request"]["parent_id"] == client_span


# -- the Trace of one request --------------------------------------------------------------------


def memory_tracer():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.tracing.otel import OtelTracer

    exporter = InMemorySpanExporter()
    return OtelTracer.to_exporter(exporter, "pdserve-proxy"), exporter


def test_a_trace_ends_its_open_calls_and_sends_each_calls_own_traceparent():
    from common.tracing import start_trace

    tracer, exporter = memory_tracer()
    traceparent, trace_id, parent_id = new_traceparent()
    trace = start_trace(tracer, "proxy.request", {"Traceparent": traceparent})
    to_p = trace.child("proxy.prefill", "client", **{"server.address": "http://p"})
    to_d = trace.child("proxy.decode", "client", **{"server.address": "http://d1"})
    other = trace.child("proxy.decode", "client", **{"server.address": "http://d2"})
    # the header sent on a call names that call's span, in the request's trace
    assert trace.headers(to_d)["traceparent"] == f"00-{trace_id}-{to_d.context.span_id:016x}-01"
    trace.end_span(to_p)
    trace.end_calls_to("http://d1", error="drain")  # a D that failed mid-stream
    assert [s.name for s in exporter.get_finished_spans()] == ["proxy.prefill", "proxy.decode"]
    assert exporter.get_finished_spans()[1].attributes["error"] == "drain"
    t0 = time.time_ns()
    trace.record("kv.read", t0 - 5_000_000, t0 - 1_000_000)
    trace.end(**{"http.status_code": 200})
    spans = {
        s.name + str(s.attributes.get("server.address", "")): s
        for s in exporter.get_finished_spans()
    }
    assert spans["proxy.decodehttp://d2"].end_time is not None  # still open: ended with the root
    root = spans["proxy.request"]
    assert root.parent.span_id == int(parent_id, 16) and root.context.trace_id == int(trace_id, 16)
    assert root.attributes["http.status_code"] == 200
    read = spans["kv.read"]
    assert (read.start_time, read.end_time) == (t0 - 5_000_000, t0 - 1_000_000)
    assert all(s.parent.span_id == root.context.span_id for s in spans.values() if s is not root)
    assert other.end_time is not None


def test_no_trace_answers_every_call_a_trace_takes():
    """With tracing off a request carries NO_TRACE: a method only Trace has would fail there,
    on the path every request takes by default."""
    import inspect

    from common.tracing import NoTrace, Trace

    def public(cls):
        return {
            name: list(inspect.signature(getattr(cls, name)).parameters.values())
            for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))
        }

    assert public(NoTrace) == public(Trace)


def test_the_traces_url():
    from common.tracing.otel import traces_url

    assert traces_url("http://jaeger:4318") == "http://jaeger:4318/v1/traces"
    assert traces_url("http://jaeger:4318/") == "http://jaeger:4318/v1/traces"
    assert traces_url("https://tempo/otlp/v1/traces") == "https://tempo/otlp/v1/traces"


# -- in-process: a worker's spans, and its trace of its own -------------------------------------


@pytest.fixture(scope="module")
def traced_worker(tiny_model):
    """A colocated decode worker served in this process, its spans kept in memory."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.api.app import build_app
    from common.api.server_config import ServerConfig
    from common.config import CacheConfig, EngineConfig, ModelConfig
    from common.engine.engine import LLMEngine
    from common.tracing.otel import OtelTracer

    config = EngineConfig(
        ModelConfig(str(tiny_model("llama")), enforce_eager=True), CacheConfig(num_blocks=32)
    )
    port = free_port()
    app = build_app(ServerConfig(role="decode", port=port), lambda: LLMEngine(config))
    exporter = InMemorySpanExporter()
    app.state.server.tracer = OtelTracer.to_exporter(exporter, "pdserve-decode")
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _is_healthy(url), timeout=60)
        yield url, exporter
    finally:
        server.should_exit = True
        thread.join(30)


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def finished_spans(exporter, trace_id: int) -> dict[str, object]:
    return {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id}


def test_a_worker_continues_the_callers_trace(traced_worker):
    url, exporter = traced_worker
    traceparent, trace_id, parent_id = new_traceparent()
    body = dict(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0)
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"traceparent": traceparent})
    assert r.status_code == 200
    names = {"decode.request", "admission", "queue", "first_step", "decode"}
    assert wait_until(lambda: names <= set(finished_spans(exporter, int(trace_id, 16))))
    spans = finished_spans(exporter, int(trace_id, 16))
    root = spans["decode.request"]
    assert root.parent.span_id == int(parent_id, 16) and root.parent.is_remote
    assert root.resource.attributes["service.name"] == "pdserve-decode"
    assert root.attributes["http.route"] == "/v1/completions"
    for name in names - {"decode.request"}:
        assert spans[name].parent.span_id == root.context.span_id, name
    assert "kv.read" not in spans  # colocated: nothing moved
    # one after the other: arrived → handed to the engine → first token → last token
    admission, first, rest = spans["admission"], spans["first_step"], spans["decode"]
    assert root.start_time == admission.start_time
    assert admission.end_time == first.start_time == spans["queue"].start_time
    assert spans["queue"].end_time <= first.end_time == rest.start_time <= rest.end_time
    assert rest.end_time <= root.end_time


def test_a_worker_called_without_traceparent_starts_its_own_trace(traced_worker):
    url, exporter = traced_worker
    before = {s.context.trace_id for s in exporter.get_finished_spans()}
    r = httpx.post(f"{url}/v1/completions", json=dict(prompt=PROMPT, max_tokens=2))
    assert r.status_code == 200

    def new_roots():
        spans = exporter.get_finished_spans()
        return [s for s in spans if s.name == "decode.request" and s.context.trace_id not in before]

    assert wait_until(lambda: len(new_roots()) == 1)
    assert new_roots()[0].parent is None


# -- off by default: nothing loaded ---------------------------------------------------------------

ZERO_COST = """
import asyncio, json, sys, threading, time
import httpx, uvicorn
from common.api.app import build_app
from common.api.server_config import ServerConfig
from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.engine import LLMEngine
from proxy.app import build_app as build_proxy
from proxy.config import parse_args as proxy_args

def serve(app, port):
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    return server

model_dir, worker_port, proxy_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = EngineConfig(ModelConfig(model_dir, enforce_eager=True), CacheConfig(num_blocks=32))
worker = build_app(ServerConfig(role="decode", port=worker_port), lambda: LLMEngine(config))
url = f"http://127.0.0.1:{worker_port}"
proxy = build_proxy(proxy_args(["--decode", url, "--mode", "colocated", "--port", str(proxy_port)]))
servers = [serve(worker, worker_port), serve(proxy, proxy_port)]
deadline = time.monotonic() + 60
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{proxy_port}/ready").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    assert time.monotonic() < deadline, "not ready"
    time.sleep(0.1)
body = dict(prompt=[5, 6, 7], max_tokens=3, stream=True)
r = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/completions", json=body, timeout=60)
assert r.status_code == 200 and "data: [DONE]" in r.text, r.text
TRACING = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
TRACING += ("common.tracing.otel",)
loaded = sorted(m for m in sys.modules if m.startswith(TRACING))
print(json.dumps({"tracers": [worker.state.server.tracer, proxy.proxy.tracer], "loaded": loaded}))
for server in servers:
    server.should_exit = True
"""


def test_without_the_flag_opentelemetry_is_not_even_imported(tiny_model):
    """A request through a proxy and a worker (both in one fresh process) loads none of
    OpenTelemetry's SDK, exporter or protobufs, nor common/tracing/otel.py, and neither has a
    tracer. (OpenTelemetry's API is loaded all the same: FastAPI imports it for telemetry of its
    own, which stays off while no global provider is set, and pdserve sets none.)"""
    ports = [str(free_port()), str(free_port())]
    out = subprocess.run(
        [sys.executable, "-c", ZERO_COST, str(tiny_model("llama")), *ports],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"tracers": [None, None], "loaded": []}
