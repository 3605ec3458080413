"""OpenTelemetry traces of requests, off unless `--otlp-traces-endpoint URL` is given.

Off, nothing of OpenTelemetry is imported: `setup_tracing(None, ...)` is None and every request
carries `NO_TRACE`, whose methods do nothing. On, `common/tracing/otel.py` (imported here, on
use) exports spans over OTLP/HTTP through a batch processor; the proxy and both workers each
set it up once per process, with their own `service.name`.

A request's spans are a `Trace`: a root span (the request on this process) and children that
end with it unless ended before. Spans that the engine thread timed (it records `time_ns`
instants and never calls OpenTelemetry) are made afterwards with those explicit start and end
times (`Trace.record`). Propagation is W3C `traceparent`/`tracestate`: a root takes its parent
from the incoming headers; `Trace.headers(span)` are the ones to send on a call made under
`span`. docs/observability.md, "Traces" has the span tree.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICE_NAMES = {
    "proxy": "pdserve-proxy",
    "prefill": "pdserve-prefill",
    "decode": "pdserve-decode",
}


@dataclass
class RequestTimes:
    """Instants (`time.time_ns()`) of one request's life that the engine thread records, for
    the spans the API layer makes once the request has finished. Written on the engine thread,
    read after the request's last output: never both at once."""

    scheduled_ns: int | None = None  # first scheduled for a step
    # D pull: its READs posted → seen landed by the forward; P push: first WRITE → all settled
    kv_transfer_ns: tuple[int, int] | None = None


def check_traces_endpoint(endpoint: str | None) -> None:
    """ValueError unless `endpoint` is None or an http(s) URL."""
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP/HTTP), got "
            f"{endpoint!r}"
        )


def setup_tracing(endpoint: str | None, role: str):
    """The process's tracer (`common.tracing.otel.OtelTracer`) exporting to `endpoint`, or None
    (tracing off: OpenTelemetry is not imported)."""
    if endpoint is None:
        return None
    from common.tracing.otel import OtelTracer

    return OtelTracer.to_otlp(endpoint, SERVICE_NAMES[role])


class Trace:
    """One request's spans on this process: `root`, and children ended with it."""

    def __init__(
        self,
        tracer,
        name: str,
        headers: Mapping[str, str] | None = None,
        start_ns: int | None = None,
        attributes: dict[str, Any] | None = None,
    ):
        self.tracer = tracer
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.root = tracer.start(name, headers, "server", self.start_ns, attributes)
        self._open: list[tuple[Any, str | None]] = []  # (span, the server it calls)

    def child(self, name: str, kind: str = "internal", **attributes):
        """A span under the root, started now; ended by `end_span`, or with the root. A call's
        span names its server in `server.address`."""
        span = self.tracer.start(name, self.root, kind, attributes=attributes)
        self._open.append((span, attributes.get("server.address")))
        return span

    def end_span(self, span, **attributes) -> None:
        for i, (open_span, _) in enumerate(self._open):
            if open_span is span:
                del self._open[i]
                self.tracer.set(span, attributes)
                span.end()
                return

    def end_calls_to(self, server: str, **attributes) -> None:
        """End the open spans of calls to `server` (one that failed while answering)."""
        for span in [span for span, to in self._open if to == server]:
            self.end_span(span, **attributes)

    def record(self, name: str, start_ns: int, end_ns: int, parent=None, **attributes):
        """A span timed elsewhere (the engine thread), under `parent` (default: the root)."""
        parent = self.root if parent is None else parent
        span = self.tracer.start(name, parent, "internal", max(start_ns, 0), attributes)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def headers(self, span=None) -> dict[str, str]:
        """`traceparent` (and `tracestate`) for a call made under `span` (default: the root)."""
        return self.tracer.headers(self.root if span is None else span)

    def set(self, **attributes) -> None:
        self.tracer.set(self.root, attributes)

    def event(self, name: str, **attributes) -> None:
        self.root.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    def end(self, end_ns: int | None = None, **attributes) -> None:
        for span, _ in self._open:
            span.end(end_time=end_ns)
        self._open.clear()
        self.tracer.set(self.root, attributes)
        self.root.end(end_time=end_ns)


class NoTrace:
    """A request's trace with tracing off: every method does nothing."""

    def child(self, name: str, kind: str = "internal", **attributes) -> None:
        return None

    def end_span(self, span, **attributes) -> None:
        pass

    def end_calls_to(self, server: str, **attributes) -> None:
        pass

    def record(self, name: str, start_ns: int, end_ns: int, parent=None, **attributes) -> None:
        return None

    def headers(self, span=None) -> dict[str, str]:
        return {}

    def set(self, **attributes) -> None:
        pass

    def event(self, name: str, **attributes) -> None:
        pass

    def end(self, end_ns: int | None = None, **attributes) -> None:
        pass


NO_TRACE = NoTrace()


def start_trace(
    tracer, name: str, headers=None, start_ns: int | None = None, attributes: dict | None = None
) -> Trace | NoTrace:
    """A request's `Trace` under `tracer`, its root's parent from `headers` (their
    `traceparent`), or `NO_TRACE` when tracing is off (`tracer` None)."""
    if tracer is None:
        return NO_TRACE
    return Trace(tracer, name, headers, start_ns, attributes)
