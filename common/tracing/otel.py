"""The OpenTelemetry side of `common.tracing`: imported only when tracing is on.

Spans go over OTLP/HTTP (protobuf) to `--otlp-traces-endpoint`, batched by a
`BatchSpanProcessor` on its own thread (its delay and sizes from the standard `OTEL_BSP_*`
environment variables). A URL with no path gets OTLP's `/v1/traces` (a collector's
`http://HOST:4318` is enough). The tracer provider is this object's, not OpenTelemetry's global:
a process may hold one, and tests may hold several, each with its own exporter.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_TRACES_PATH = "/v1/traces"
_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint`, or with `/v1/traces` when it has no path."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


class OtelTracer:
    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_otlp(cls, endpoint: str, service_name: str) -> OtelTracer:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(endpoint))))
        return cls(provider)

    @classmethod
    def to_exporter(cls, exporter: SpanExporter, service_name: str) -> OtelTracer:
        """Spans handed to `exporter` as each ends (tests: an `InMemorySpanExporter`)."""
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    def start(self, name: str, parent=None, kind: str = "internal", start_ns=None, attributes=None):
        """A span started at `start_ns` (default now) under `parent`: a span, the headers of
        an incoming request (their `traceparent`; none: a new trace), or None (a new trace)."""
        if parent is None or isinstance(parent, Mapping):
            context = self.propagator.extract(_lower(parent or {}))
        else:
            context = trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name, context, _KINDS[kind], attributes=_clean(attributes), start_time=start_ns
        )

    def headers(self, span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier

    def set(self, span, attributes: dict | None) -> None:
        if attributes:
            span.set_attributes(_clean(attributes))

    def shutdown(self) -> None:
        """Export what is left, then stop the exporter's thread."""
        self.provider.shutdown()


def _clean(attributes: dict | None) -> dict:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace headers of `headers`, keys lower-cased (a Starlette `Headers` already is)."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
