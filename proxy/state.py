"""What the proxy's routes share: `Proxy` (config, worker pools, health checks, orchestration,
metrics) and the API-key check. The app (proxy/app.py) builds it; the admin routes
(proxy/admin.py) use it too, so both import it from here and the imports point one way.
"""

from __future__ import annotations

import hmac
import time

from fastapi import Request

from common.api.errors import AuthenticationError
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.upstream import make_client
from proxy.workers import ROLES, Worker, WorkerPool, normalize_url


class Proxy:
    """What the routes share: config, worker pools, health checks, orchestration, metrics."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.pools = {role: WorkerPool(role) for role in ROLES}
        self.metrics = ProxyMetrics(self.pools)
        self.orchestrator = Orchestrator(cfg, self.pools, self.metrics)
        self.health = HealthChecker(cfg.health, self.all_workers)
        self.removed: list[Worker] = []  # by an admin; their clients close at shutdown
        self.started_at = int(time.time())

    def all_workers(self) -> list[Worker]:
        return [w for pool in self.pools.values() for w in pool.workers]

    def add_worker(self, role: str, url: str) -> Worker:
        url = normalize_url(url)
        worker = Worker(url, role, *make_client(url, self.cfg.connect_timeout))
        self.pools[role].add(worker)
        return worker

    @property
    def is_ready(self) -> bool:
        needs_prefill = self.cfg.mode != "colocated" and len(self.pools["prefill"]) > 0
        has_prefill = bool(self.pools["prefill"].routable())
        return bool(self.pools["decode"].routable()) and (has_prefill or not needs_prefill)

    async def start(self) -> None:
        for role in ROLES:
            for url in getattr(self.cfg, role):
                self.add_worker(role, url)
        await self.health.check_all()  # /ready is true from the first moment it can be
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.orchestrator.close()
        for worker in self.all_workers() + self.removed:
            await worker.client.aclose()


def check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), key):
        raise AuthenticationError(
            "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
        )
