"""One request through the workers, as the named stages of proxy/journey/ (docs/design.md, "A
request's path"): plan (which D, and P first or D alone), prefill (P computes the prompt; D
reserves for a push or lends a prefix), decode (the call to D), relay (D's stream to the
client, a failed D's choices moved by migration).

The orchestrator composes them and opens the route's span; each stage opens the spans of its
own calls to workers. `pdserve_proxy_routed_total{path, reason}` counts the plans taken.
"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi.responses import Response

from proxy.config import ProxyConfig
from proxy.inflight import InFlight
from proxy.journey.calls import WorkerCalls, upstream_error_response
from proxy.journey.client import ClientStream
from proxy.journey.decode import Decodes, Upstream
from proxy.journey.migration import Migration
from proxy.journey.plan import COLOCATED, Plan, Planner
from proxy.journey.prefill import Prefilled, Prefills
from proxy.journey.relay import Relay
from proxy.kv_events import KVEventFeeds
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.request import ProxyRequest
from proxy.sse import EventStreamResponse
from proxy.upstream import UpstreamError
from proxy.workers import WorkerPool


class Orchestrator:
    def __init__(
        self,
        cfg: ProxyConfig,
        pools: dict[str, WorkerPool],
        metrics: ProxyMetrics,
        kv_events: KVEventFeeds,
    ):
        self.cfg = cfg
        self.metrics = metrics
        self.calls = WorkerCalls(cfg, metrics)
        self.inflight = InFlight()  # prefills, cut short when health checks eject their P
        kv = KVRouter(cfg, pools, kv_events, metrics)
        self.planner = Planner(cfg, pools, kv, metrics)
        self.prefills = Prefills(self.planner, kv, self.calls, self.inflight, metrics)
        self.decodes = Decodes(self.planner, self.prefills, self.calls, self.inflight, metrics)

    async def handle(self, req: ProxyRequest) -> Response:
        start = time.perf_counter()
        plan, prefilled = await self._plan_and_prefill(req)
        if not req.is_stream:
            return await self.decodes.whole(req, plan.decode, prefilled)
        relay = self._relay(req)
        if (
            prefilled is not None
            and prefilled.has_first_token
            and self.cfg.first_token_from_prefill
            and req.can_stream_first_token
        ):
            return EventStreamResponse(relay.after_first_token(plan.decode, prefilled, start))
        try:
            resp, decode = await self.decodes.open(req, plan.decode, prefilled)
        except UpstreamError as e:
            self.prefills.give_back(prefilled)
            return upstream_error_response(e)
        first = Upstream(resp, decode, tuple(relay.client.choices), prefilled)
        return EventStreamResponse(relay.run(first, start))

    async def _plan_and_prefill(self, req: ProxyRequest) -> tuple[Plan, Prefilled | None]:
        routing = req.trace.child("proxy.route")
        plan = await self.planner.plan(req)
        req.trace.end_span(routing, **{"pdserve.path": plan.path, "pdserve.reason": plan.reason})
        prefilled = None
        if plan.is_disaggregated:
            prefilled = await self.prefills.prefill(req, plan)
            if prefilled is None:
                plan = replace(plan, path=COLOCATED, reason="prefill_failed")
        req.trace.set(**{"pdserve.path": plan.path, "pdserve.reason": plan.reason})
        self.metrics.routed.labels(plan.path, plan.reason).inc()
        return plan, prefilled

    def _relay(self, req: ProxyRequest) -> Relay:
        client = ClientStream(req)
        migration = Migration(
            req, client, self.planner, self.prefills, self.decodes, self.calls, self.metrics
        )
        return Relay(
            req, client, migration, self.decodes, self.prefills, self.calls, self.inflight,
            self.metrics,
        )  # fmt: skip

    async def close(self) -> None:
        await self.calls.close()
