"""What one proxy process (of `--workers N`, proxy/processes.py) asks of the others: to apply an
admin change it received, their workers (when it was started again, or for a list of every
process's view), and their metrics for a merged `/metrics`, and whether they are ready.

Calls go to each sibling's private loopback address and carry the peer token
(`X-Pdserve-Peer`): a sibling applies such an admin change without sending it on, and answers
such a `/metrics` with its own numbers only. Merging sums counters and histograms (every process
counts its own requests) and gauges of amounts (requests in flight, queue depth); the gauges that
are a process's view of the pools (`pdserve_proxy_workers`, `pdserve_proxy_discovered_workers`,
and `pdserve_proxy_kv_index_blocks`: each process subscribes to every worker's KV events) take
the largest value any process reports.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.credentials import is_same_secret
from proxy.processes import ProcessInfo

PEER_HEADER = "x-pdserve-peer"
VIEW_GAUGES = {  # each process holds its own view of the same thing: the largest, not the sum
    "pdserve_proxy_workers",
    "pdserve_proxy_discovered_workers",
    "pdserve_proxy_kv_index_blocks",  # every process indexes every worker's KV events
    "pdserve_proxy_worker_healthy",
}
TIMEOUT_S = 5.0
READY_TIMEOUT_S = 1.0  # a sibling that cannot say it is ready in this time is not
ADMIN_TIMEOUT_S = 30.0  # an admin change waits for a sibling that is still starting

logger = logging.getLogger(__name__)


class Siblings:
    def __init__(self, info: ProcessInfo):
        self.info = info
        self._client = httpx.AsyncClient(timeout=TIMEOUT_S, headers={PEER_HEADER: info.token})

    def is_peer(self, headers) -> bool:
        """The request came from a sibling (not from a client that only says so)."""
        return is_same_secret(headers.get(PEER_HEADER), self.info.token)

    async def broadcast(self, path: str, body: bytes, headers: dict) -> list[dict | None]:
        """POST an admin change to every sibling: each one's answer (None: not applied)."""
        return await asyncio.gather(
            *(self._post(url + path, body, headers) for url in self.info.others)
        )

    async def _post(self, url: str, body: bytes, headers: dict) -> dict | None:
        try:
            r = await self._client.post(url, content=body, headers=headers, timeout=ADMIN_TIMEOUT_S)
        except httpx.HTTPError as e:
            logger.warning("admin change not applied by sibling %s: %r", url, e)
            return None
        if r.status_code != 200:
            logger.warning("admin change refused by sibling %s: %s", url, r.text)
            return None
        return r.json()

    async def workers(self, headers: dict) -> list[dict] | None:
        """The first answering sibling's `GET /admin/workers` list; None if none answered."""
        for url in self.info.others:
            view = await self._view(url, headers)
            if "workers" in view:
                return view["workers"]
        return None

    async def views(self, headers: dict) -> list[dict]:
        """Every sibling's `GET /admin/workers` (`{"process", "workers"}`), or `{"process",
        "error"}` for one that did not answer."""
        others = [(i, url) for i, url in enumerate(self.info.siblings) if i != self.info.index]
        views = await asyncio.gather(*(self._view(url, headers) for _, url in others))
        return [{"process": i, **view} for (i, _), view in zip(others, views, strict=True)]

    async def _view(self, url: str, headers: dict) -> dict:
        try:
            r = await self._client.get(url + "/admin/workers", headers=headers)
        except httpx.HTTPError as e:
            logger.warning("no worker list from sibling %s: %r", url, e)
            return {"error": repr(e)}
        if r.status_code != 200:
            logger.warning("no worker list from sibling %s: %s", url, r.text)
            return {"error": f"{r.status_code}: {r.text}"}
        return {"workers": r.json()["workers"]}

    async def metrics(self) -> list[str]:
        """The siblings' own metrics (one that does not answer is left out, and logged)."""
        answers = await asyncio.gather(
            *(self._client.get(url + "/metrics") for url in self.info.others),
            return_exceptions=True,
        )
        texts = []
        for url, r in zip(self.info.others, answers, strict=True):
            if isinstance(r, BaseException) or r.status_code != 200:
                logger.warning("no metrics from sibling %s: %r", url, r)
            else:
                texts.append(r.text)
        return texts

    async def not_ready(self) -> list[str]:
        """The siblings that do not answer their own `/ready` with 200 (their private URLs).

        Connections spread over the processes, so the proxy is ready only when every process
        is: each runs its own health checks, and one may not have seen a worker come up yet."""
        ask = [
            self._client.get(url + "/ready", timeout=READY_TIMEOUT_S) for url in self.info.others
        ]
        answers = await asyncio.gather(*ask, return_exceptions=True)
        return [
            url
            for url, r in zip(self.info.others, answers, strict=True)
            if isinstance(r, BaseException) or r.status_code != 200
        ]

    async def aclose(self) -> None:
        await self._client.aclose()


def merge_metrics(texts: list[str]) -> bytes:
    """Prometheus texts of processes with the same metrics, as one (see the module's doc)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            into = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                into[key] = _combine(merged, s.name, into.get(key), s.value)
    for name, merged in families.items():
        merged.samples = [Sample(n, dict(labels), v) for (n, labels), v in values[name].items()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _combine(family: Metric, sample: str, old: float | None, new: float) -> float:
    if old is None:
        return new
    if sample.endswith("_created"):
        return min(old, new)
    if family.type == "gauge" and family.name in VIEW_GAUGES:
        return max(old, new)
    return old + new


class _Fixed:
    """A collector that yields metric families built elsewhere."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
