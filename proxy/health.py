"""Active health checks: every worker's `GET /health`, each `interval` seconds, with a timeout.

`failure_threshold` consecutive failures eject a worker, `success_threshold` consecutive
successes readmit it; `on_eject(worker)` runs on every failed check of an ejected worker from
then on (the orchestrator cuts the prefills waiting on it). Requests eject a worker passively
(`Worker.eject`) on a connect error; only these checks bring it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from proxy.config import HealthConfig
from proxy.workers import Worker

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        cfg: HealthConfig,
        workers: Callable[[], list[Worker]],
        on_eject: Callable[[Worker], None] = lambda worker: None,
    ):
        self.cfg = cfg
        self.workers = workers
        self.on_eject = on_eject
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers()))

    async def check(self, worker: Worker) -> None:
        if worker.client.is_closed:  # removed since the list was taken
            return
        try:
            r = await worker.client.get("/health", timeout=self.cfg.timeout)
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {type(e).__name__}"
        if worker.record_check(ok, why, self.cfg.failure_threshold, self.cfg.success_threshold):
            state = "healthy" if worker.is_healthy else f"unhealthy ({why})"
            logger.warning("%s worker %s is %s", worker.role, worker.url, state)
        if not ok and not worker.is_healthy and worker.num_failures >= self.cfg.failure_threshold:
            self.on_eject(worker)  # NOTE: again each time: it may have been ejected passively

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval)
