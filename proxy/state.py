"""What the proxy's routes share: `Proxy` (config, worker pools, health checks, discovery,
KV event subscriptions, orchestration, metrics) and the API-key check. The app (proxy/app.py)
builds it; the admin routes (proxy/admin.py) use it too, so both import it from here and the
imports point one way.

Workers join and leave the pools here, whoever asks (the admin routes, DNS discovery): a joining
worker is checked at once; a removed one leaves routing at once and its client closes once its
running requests finish; a retired one is drained first and removed once idle.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request

from common.api.errors import AuthenticationError
from common.credentials import is_same_secret
from common.tracing import setup_tracing
from proxy.admission import Admission
from proxy.config import ProxyConfig
from proxy.discovery import DnsDiscovery, make_resolver
from proxy.health import HealthChecker
from proxy.kv_events import KVEventFeeds
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.processes import ProcessInfo
from proxy.siblings import Siblings
from proxy.upstream import make_client
from proxy.workers import ROLES, Worker, WorkerPool, normalize_url

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often a removed or retiring worker's running requests are counted


class Proxy:
    """What the routes share: config, worker pools, health checks, discovery, orchestration,
    metrics."""

    def __init__(self, cfg: ProxyConfig, process: ProcessInfo | None = None):
        self.cfg = cfg
        self.process_index = process.index if process else 0
        self.siblings = Siblings(process) if process and process.count > 1 else None
        self.pools = {role: WorkerPool(role) for role in ROLES}
        self.metrics = ProxyMetrics(self.pools)
        self.count_answered = self.metrics.process_requests.labels(str(self.process_index)).inc
        internal = {"X-Internal-Token": cfg.internal_token} if cfg.internal_token else {}
        self.kv_events = KVEventFeeds(self.all_workers, internal, cfg.connect_timeout)
        self.metrics.index_sizes = self.kv_events.sizes
        self.orchestrator = Orchestrator(cfg, self.pools, self.metrics, self.kv_events)
        self.admission = Admission(cfg, self.metrics)
        self.health = HealthChecker(
            cfg.health, self.all_workers, on_eject=self.orchestrator.inflight.cut
        )
        names = [(role, name) for role in ROLES for name in cfg.dns_names(role)]
        resolver = make_resolver(cfg.dns_server_address) if names else None
        self.discoveries = [
            DnsDiscovery(role, name, resolver, cfg.discovery_interval, self, self.metrics)
            for role, name in names
        ]
        self.removed: list[Worker] = []  # out of the pools; their clients close once idle
        self._closers: set[asyncio.Task] = set()
        self.started_at = int(time.time())
        self.tracer = None  # common.tracing.otel.OtelTracer, set up by start() when asked for

    def all_workers(self) -> list[Worker]:
        return [w for pool in self.pools.values() for w in pool.workers]

    def members(self, role: str, source: str) -> list[Worker]:
        return [w for w in self.pools[role].workers if w.source == source]

    def find_worker(self, url: str) -> Worker | None:
        return next((w for p in self.pools.values() if (w := p.get(url)) is not None), None)

    def add_worker(self, role: str, url: str, source: str = "static") -> Worker:
        url = normalize_url(url)
        lean = self.cfg.http_client == "lean"
        worker = Worker(url, role, *make_client(url, self.cfg.connect_timeout, lean), source=source)
        self.pools[role].add(worker)
        return worker

    async def admit_worker(self, role: str, url: str, source: str) -> Worker:
        """Add a worker and check it at once: routable as soon as it is healthy."""
        worker = self.add_worker(role, url, source)
        await self.health.check(worker)
        return worker

    def remove_worker(self, worker: Worker) -> None:
        """Out of routing now; its running requests finish, then its client closes."""
        pool = self.pools[worker.role]
        if pool.get(worker.url) is not worker:  # already removed (and its URL maybe back)
            return
        pool.remove(worker.url)
        self.removed.append(worker)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(worker))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def retire_worker(self, worker: Worker) -> None:
        """Drain (no new requests), wait for the running ones, remove."""
        worker.is_draining = True
        await _until_idle(worker)
        self.remove_worker(worker)

    async def _close_when_idle(self, worker: Worker) -> None:
        await _until_idle(worker)
        self.removed.remove(worker)
        await worker.client.aclose()

    @property
    def is_ready(self) -> bool:
        needs_prefill = self.cfg.mode != "colocated" and len(self.pools["prefill"]) > 0
        has_prefill = bool(self.pools["prefill"].routable())
        return bool(self.pools["decode"].routable()) and (has_prefill or not needs_prefill)

    async def start(self) -> None:
        # NOTE: here, in the process that serves (a batch exporter's thread does not fork)
        self.tracer = self.tracer or setup_tracing(self.cfg.otlp_traces_endpoint, "proxy")
        for role in ROLES:
            for url in self.cfg.static_urls(role):
                self.add_worker(role, url)
        if self.siblings is not None and self.siblings.info.restarted:
            await self._catch_up()
        await asyncio.gather(*(d.refresh() for d in self.discoveries))
        await self.health.check_all()  # /ready is true from the first moment it can be
        self.health.start()
        if self.cfg.kv_routing:
            await self.kv_events.sync()  # subscribed before the first request, where it can be
            self.kv_events.start()
        for discovery in self.discoveries:
            discovery.start()

    async def _catch_up(self) -> None:
        """A process started again takes the admin changes its siblings applied before (workers
        added, drained, removed); workers found by DNS it finds itself."""
        key = self.cfg.effective_admin_key
        if key is None:  # no admin routes: nothing can have changed
            return
        view = await self.siblings.workers({"authorization": f"Bearer {key}"})
        if view is None:
            logger.warning("no sibling answered: serving the configured workers")
            return
        theirs = {w["url"]: w for w in view if w["source"] in ("static", "admin")}
        for worker in self.members("prefill", "static") + self.members("decode", "static"):
            if worker.url not in theirs:
                self.remove_worker(worker)
        for url, w in theirs.items():
            worker = self.find_worker(url) or self.add_worker(w["role"], url, w["source"])
            worker.is_draining = w["draining"]
        logger.info("caught up with a sibling: %d workers", len(theirs))

    async def stop(self) -> None:
        await asyncio.gather(*(d.stop() for d in self.discoveries))
        await self.health.stop()
        await self.kv_events.stop()
        for task in list(self._closers):
            task.cancel()
        await asyncio.gather(*self._closers, return_exceptions=True)
        await self.orchestrator.close()
        for worker in self.all_workers() + self.removed:
            await worker.client.aclose()
        if self.siblings is not None:
            await self.siblings.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans still batched are sent


async def _until_idle(worker: Worker) -> None:
    while worker.num_outstanding > 0:
        await asyncio.sleep(IDLE_POLL_S)


def bearer_key(request: Request) -> str | None:
    """The client's `Authorization: Bearer KEY`, if it sent one."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None


def check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not is_same_secret(given.strip(), key):
        raise AuthenticationError(
            "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
        )
