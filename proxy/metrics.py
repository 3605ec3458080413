"""The proxy's Prometheus metrics (its own registry).

`pdserve_proxy_routed_total{path, reason}` shows conditional disaggregation at work: `path` is
`disaggregated` or `colocated`, `reason` why (`mode`, `short_prompt`, `no_prefill`,
`prefill_failed`, `batch`, ...). `pdserve_proxy_discovery_errors_total{role, name, reason}` and
`pdserve_proxy_discovered_workers{role, name}` follow each `dns://NAME:PORT` pool entry
(proxy/discovery.py). Admission (proxy/admission.py):
`pdserve_proxy_admission_rejected_total{reason}` (`rate_limited`, `queue_full`,
`queue_timeout`), `pdserve_proxy_queue_depth`, `pdserve_proxy_admitted_running` (slots held)
and `pdserve_proxy_queue_wait_seconds`. KV-aware routing (proxy/kv_routing.py):
`pdserve_proxy_prefix_hit_blocks{role}` (prompt blocks the chosen worker held, by its KV events)
and `pdserve_proxy_prefix_query_blocks{role}` (the prompts' full blocks),
`pdserve_proxy_kv_fallbacks_total{reason}`, `pdserve_proxy_render_seconds`,
`pdserve_proxy_kv_index_blocks{role, url}`; and what P itself reports in each answer's usage:
`pdserve_proxy_prefill_cached_tokens` of `pdserve_proxy_prefill_prompt_tokens`. Migration
(proxy/journey/migration.py): `pdserve_proxy_migrations_total{reason}` (`connection`, `timeout`,
`error_event`, `ejected`, `drain`, `truncated`), `pdserve_proxy_migrations_refused_total{reason}`
(`limit`, `no_decode`, `untracked`, `rejected`, `unsupported`: a worker that does not
say it continued) and
`pdserve_proxy_migration_recomputed_tokens_total`. Whose fault a worker's error was:
`pdserve_proxy_upstream_faults_total{role, fault}` (`request`: a 4xx status or error event,
passed on and never retried or moved; `worker`: anything else). Session affinity
(proxy/sessions.py): `pdserve_proxy_session_routed_total{role, outcome}` (`kept`, `hashed`,
`moved_load`, `moved_gone`), the requests with an X-Session-ID. Each worker as this process sees it:
`pdserve_proxy_worker_healthy{role, url}` (1 or 0) and `pdserve_proxy_worker_ejections_total{role,
url}` (healthy to unhealthy, by health checks or a failed request). The reasons and roles above
that are known in advance start at 0, so that a rate over them reads 0 rather than nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proxy.workers import Worker, WorkerPool

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ADMISSION_REASONS = ("rate_limited", "queue_full", "queue_timeout")
MIGRATION_REASONS = ("connection", "timeout", "error_event", "ejected", "drain", "truncated")
REFUSAL_REASONS = ("limit", "no_decode", "untracked", "rejected", "unsupported")
UPSTREAM_ERROR_KINDS = ("connect", "timeout", "transport", "ejected")  # and http_{status}
FAULTS = ("request", "worker")
SESSION_OUTCOMES = ("kept", "hashed", "moved_load", "moved_gone")


class _WorkerCollector:
    """`pdserve_proxy_worker_healthy` and `pdserve_proxy_worker_ejections_total`, one series
    per worker in the pools now (a removed worker's series end with it)."""

    def __init__(self, pools: dict[str, WorkerPool]):
        self.pools = pools

    def collect(self):
        healthy = GaugeMetricFamily(
            "pdserve_proxy_worker_healthy",
            "1 while this proxy process routes to the worker (healthy, not draining), else 0",
            labels=["role", "url"],
        )
        ejections = CounterMetricFamily(
            "pdserve_proxy_worker_ejections",
            "Times the worker went from healthy to unhealthy (health checks or a failed call)",
            labels=["role", "url"],
        )
        for role, pool in self.pools.items():
            for worker in pool.workers:
                healthy.add_metric([role, worker.url], int(worker.is_routable))
                ejections.add_metric([role, worker.url], worker.num_ejections)
        yield healthy
        yield ejections


class ProxyMetrics:
    def __init__(self, pools: dict[str, WorkerPool]):
        self.pools = pools
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_proxy_requests", "Answered requests", ["endpoint", "status"], registry=r
        )
        self.process_requests = Counter(
            "pdserve_proxy_process_requests",
            "Answered requests by proxy process (--workers; merged /metrics shows each)",
            ["process"],
            registry=r,
        )
        self.routed = Counter(
            "pdserve_proxy_routed", "Requests by path and reason", ["path", "reason"], registry=r
        )
        self.upstream_errors = Counter(
            "pdserve_proxy_upstream_errors",
            "Failed calls to workers",
            ["role", "kind"],
            registry=r,
        )
        self.upstream_faults = Counter(
            "pdserve_proxy_upstream_faults",
            "Failed calls to workers and error events in their streams, by whose fault: request "
            "(a 4xx: passed on, final) or worker (retried or moved)",
            ["role", "fault"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_proxy_retries", "Calls retried on another worker", ["role"], registry=r
        )
        self.stream_errors = Counter(
            "pdserve_proxy_stream_errors", "Streams ended by an error event", registry=r
        )
        self.disconnects = Counter(
            "pdserve_proxy_client_disconnects", "Clients gone before the end", registry=r
        )
        self.ttft = Histogram(
            "pdserve_proxy_time_to_first_byte_seconds",
            "Arrival to the first byte sent to the client",
            buckets=_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "pdserve_proxy_prefill_seconds", "Prefill calls", buckets=_BUCKETS, registry=r
        )
        self.workers = Gauge(
            "pdserve_proxy_workers", "Workers by role and state", ["role", "state"], registry=r
        )
        self.outstanding = Gauge(
            "pdserve_proxy_outstanding", "Requests in flight by role", ["role"], registry=r
        )
        self.discovery_errors = Counter(
            "pdserve_proxy_discovery_errors",
            "Failed resolutions of a dns:// pool entry (its last good set stays)",
            ["role", "name", "reason"],
            registry=r,
        )
        self.discovered = Gauge(
            "pdserve_proxy_discovered_workers",
            "Addresses of a dns:// pool entry in use (the last good answer)",
            ["role", "name"],
            registry=r,
        )
        self.session_routed = Counter(
            "pdserve_proxy_session_routed",
            "Requests with an X-Session-ID, by role and how their worker was chosen "
            "(proxy/sessions.py)",
            ["role", "outcome"],
            registry=r,
        )

        self._add_admission_metrics(r)
        self._add_kv_routing_metrics(r)
        self._add_migration_metrics(r)
        r.register(_WorkerCollector(pools))
        for role in pools:
            self.retries.labels(role)
            for outcome in SESSION_OUTCOMES:
                self.session_routed.labels(role, outcome)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(role, kind)
            for fault in FAULTS:
                self.upstream_faults.labels(role, fault)

    def _add_migration_metrics(self, r: CollectorRegistry) -> None:
        self.migrations = Counter(
            "pdserve_proxy_migrations",
            "Choices of a request moved to another decode worker, by why its worker failed",
            ["reason"],
            registry=r,
        )
        self.migrations_refused = Counter(
            "pdserve_proxy_migrations_refused",
            "Failed decode streams that could not move (they end with an error event), by reason",
            ["reason"],
            registry=r,
        )
        self.migration_recomputed = Counter(
            "pdserve_proxy_migration_recomputed_tokens",
            "Tokens recomputed on the worker that continues a moved request",
            registry=r,
        )
        self.reverse_pulls = Counter(
            "pdserve_proxy_reverse_pulls",
            "Prefills offered a prompt prefix that the decode worker holds (the reverse pull), "
            "by outcome: lent, nothing_cached (D's events were ahead of its cache), failed",
            ["outcome"],
            registry=r,
        )
        self.reverse_pull_tokens = Counter(
            "pdserve_proxy_reverse_pull_tokens",
            "Prompt tokens prefill workers read from decode workers instead of computing them "
            "(the reverse pull: those lent past P's own cache, by P's usage)",
            registry=r,
        )
        for outcome in ("lent", "nothing_cached", "failed"):
            self.reverse_pulls.labels(outcome)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        for reason in REFUSAL_REASONS:
            self.migrations_refused.labels(reason)

    def _add_admission_metrics(self, r: CollectorRegistry) -> None:
        self.admission_rejected = Counter(
            "pdserve_proxy_admission_rejected",
            "Requests refused with 429 by admission control",
            ["reason"],
            registry=r,
        )
        for reason in ADMISSION_REASONS:
            self.admission_rejected.labels(reason)
        self.queue_depth = Gauge(
            "pdserve_proxy_queue_depth", "Requests waiting for a slot", registry=r
        )
        self.admitted_running = Gauge(
            "pdserve_proxy_admitted_running", "Requests holding a slot", registry=r
        )
        self.queue_wait = Histogram(
            "pdserve_proxy_queue_wait_seconds",
            "Arrival in the queue to a slot, for admitted requests",
            buckets=_BUCKETS,
            registry=r,
        )

    def _add_kv_routing_metrics(self, r: CollectorRegistry) -> None:
        self.prefix_hit_blocks = Counter(
            "pdserve_proxy_prefix_hit_blocks",
            "Prompt blocks the chosen worker held (its KV events), by role",
            ["role"],
            registry=r,
        )
        self.prefix_query_blocks = Counter(
            "pdserve_proxy_prefix_query_blocks",
            "Full prompt blocks of requests routed by KV events, by role",
            ["role"],
            registry=r,
        )
        self.kv_fallbacks = Counter(
            "pdserve_proxy_kv_fallbacks",
            "Choices made without the workers' KV events, by reason",
            ["reason"],
            registry=r,
        )
        self.render_seconds = Histogram(
            "pdserve_proxy_render_seconds",
            "Render calls for a prompt's token ids",
            buckets=_BUCKETS,
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "pdserve_proxy_kv_index_blocks",
            "Blocks a worker holds, by its KV events",
            ["role", "url"],
            registry=r,
        )
        self.index_sizes: Callable[[], Iterable[tuple[Worker, int]]] = tuple  # set by the feeds
        self.prefill_cached_tokens = Counter(
            "pdserve_proxy_prefill_cached_tokens",
            "Prompt tokens P served from its prefix cache, as its answers report",
            registry=r,
        )
        self.prefill_prompt_tokens = Counter(
            "pdserve_proxy_prefill_prompt_tokens", "Prompt tokens of P's answers", registry=r
        )

    def count_prefill_usage(self, answer: dict, num_lent: int = 0) -> None:
        """P's own word on its prefix cache: `usage.prompt_tokens_details.cached_tokens`; and
        of the `num_lent` tokens D lent it (the reverse pull), those past its own cache: what
        P read from D."""
        usage = answer.get("usage")
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and isinstance(cached, int):
            self.prefill_prompt_tokens.inc(prompt)
            self.prefill_cached_tokens.inc(cached)
            self.reverse_pull_tokens.inc(max(0, num_lent - cached))

    def render(self) -> bytes:
        for role, pool in self.pools.items():
            healthy = sum(w.is_healthy and not w.is_draining for w in pool.workers)
            draining = sum(w.is_draining for w in pool.workers)
            self.workers.labels(role, "healthy").set(healthy)
            self.workers.labels(role, "draining").set(draining)
            self.workers.labels(role, "unhealthy").set(len(pool) - healthy - draining)
            self.outstanding.labels(role).set(sum(w.num_outstanding for w in pool.workers))
        self.kv_index_blocks.clear()  # workers gone from the pools leave the gauge
        for worker, num_blocks in self.index_sizes():
            self.kv_index_blocks.labels(worker.role, worker.url).set(num_blocks)
        return generate_latest(self.registry)
