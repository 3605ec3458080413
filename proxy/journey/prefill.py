"""The proxy's side of a prompt computed on P, the counterpart of a worker's RemotePrefills: it
owns what a request holds on the workers until D reads it, and gives back what D never will.

- **Prefill.** P computes the prompt and one token and keeps the KV (pull) or writes it into
  blocks D reserved first (push: `/internal/kv/reserve`; None, a pull, when D cannot spare
  them). A P that fails is ejected (connect errors) and the next one is tried; when none is
  left the request goes to D alone. A P that the health checks eject while a prefill waits on
  it (frozen) fails that prefill at once, retried the same way (proxy/inflight.py).
- **The reverse pull.** When D holds a longer prefix of the prompt than P (an earlier turn's
  answer) by `--reverse-pull-min-tokens`, D leases those blocks (`/internal/kv/lease`, asked
  at the same time as the reservation) and P reads them instead of computing them; the lease
  ends once P answered (in push mode D's reservation starts with the blocks it holds, and P
  writes only the rest).
- **Giving back.** What P still holds for a request that will not read it (pull), or the
  reservation on D (push), is released (leases and reservations expire anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from proxy.inflight import InFlight
from proxy.journey.calls import UpstreamAPIError, WorkerCalls
from proxy.journey.plan import Plan, Planner
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.request import ProxyRequest
from proxy.upstream import UpstreamError, post_json
from proxy.workers import Worker

logger = logging.getLogger(__name__)


@dataclass
class Prefilled:
    worker: Worker  # the P that holds (pull) or wrote (push) the prompt's KV
    answer: dict  # P's response: the first token
    params: dict  # P's kv_transfer_params, for D
    push_to: dict | None = None  # push: the reservation on D
    reserved_on: Worker | None = None  # push: the D that holds the reservation

    @property
    def has_first_token(self) -> bool:
        return self.params.get("first_token_id") is not None


@dataclass
class Lent:
    """The reverse pull: a prompt prefix D holds under a lease for P to read."""

    params: dict  # D's kv_transfer_params for P (prefix_only)
    num_tokens: int  # the tokens its blocks hold


class Prefills:
    def __init__(
        self,
        planner: Planner,
        kv: KVRouter,
        calls: WorkerCalls,
        inflight: InFlight,
        metrics: ProxyMetrics,
    ):
        self.cfg = planner.cfg
        self.planner = planner
        self.kv = kv
        self.calls = calls
        self.inflight = inflight
        self.metrics = metrics

    async def prefill(self, req: ProxyRequest, plan: Plan) -> Prefilled | None:
        """P's answer and where the KV is, by `plan` (disaggregated), or None when no P could
        give it (D computes it). UpstreamAPIError: P (or D's reservation) refused the request."""
        assert plan.is_disaggregated, "a prefill is planned"
        decode, token_ids = plan.decode, plan.token_ids
        tried: tuple[Worker, ...] = ()
        for attempt in range(1 + self.cfg.max_retries):
            if not self.planner.pools["prefill"].routable(exclude=tried):
                return None
            worker = self.planner.choose("prefill", req, tried, token_ids)
            tried += (worker,)
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            push_to, lent = await self._reserve_and_borrow(req, worker, plan)
            try:
                answer = await self._call(req, worker, token_ids, push_to, lent)
            except UpstreamError as e:
                self.calls.failed(e)
                if push_to is not None:
                    self.calls.release(decode, {"reservation_id": push_to["reservation_id"]})
                if e.is_client_error:
                    raise UpstreamAPIError(e) from e
                continue
            finally:
                if lent is not None:  # read (P let it go already) or not: D's lease ends
                    self.calls.release(decode, {"request_id": lent.params["remote_request_id"]})
            self.metrics.count_prefill_usage(answer, lent.num_tokens if lent else 0)
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict):
                logger.warning("prefill worker %s returned no kv_transfer_params", worker.url)
                return None
            return Prefilled(worker, answer, params, push_to, decode if push_to else None)
        return None

    async def _call(
        self,
        req: ProxyRequest,
        worker: Worker,
        token_ids: list[int] | None,
        push_to: dict | None,
        lent: Lent | None,
    ) -> dict:
        """P's answer to one prefill call."""
        started = time.perf_counter()
        worker.num_outstanding += 1
        try:
            with self.calls.span(req, "proxy.prefill", worker) as span:
                body = req.prefill_body(push_to, lent and lent.params)
                headers = self.calls.headers(req, span)
                timeout = self.calls.prefill_timeout
                with self.kv.prefilling(worker, token_ids):
                    answer = await self.inflight.call(
                        worker, post_json(worker, req.path, body, headers, timeout)
                    )
        finally:
            worker.num_outstanding -= 1
        req.trace.set(**{"pdserve.prefill_url": worker.url})
        self.metrics.prefill.observe(time.perf_counter() - started)
        return answer

    async def _reserve_and_borrow(
        self, req: ProxyRequest, prefill: Worker, plan: Plan
    ) -> tuple[dict | None, Lent | None]:
        """What D does before P starts, both asked at once: the push reservation (by the plan)
        and the prefix it lends (the reverse pull); a lease is given back if the reservation
        fails."""
        decode = plan.decode
        lending = asyncio.ensure_future(self._borrow_prefix(req, prefill, decode, plan.token_ids))
        try:
            push_to = await self._reserve(req, decode) if plan.is_push else None
        except BaseException:
            if (lent := await lending) is not None:
                self.calls.release(decode, {"request_id": lent.params["remote_request_id"]})
            raise
        return push_to, await lending

    async def _borrow_prefix(
        self,
        req: ProxyRequest,
        prefill: Worker,
        decode: Worker,
        token_ids: list[int] | None,
    ) -> Lent | None:
        """The reverse pull: the prompt prefix D holds beyond P's, leased on D for P to read,
        when that saves `reverse_pull_min_tokens`; else None."""
        limit = self.cfg.reverse_pull_min_tokens
        if not limit or token_ids is None:
            return None
        if self.kv.reverse_gain(prefill, decode, token_ids) < limit:
            return None
        try:
            with self.calls.span(req, "proxy.lease_prefix", decode):
                answer = await post_json(
                    decode,
                    "/internal/kv/lease",
                    {"token_ids": token_ids},
                    self.calls.internal,
                    self.calls.internal_timeout,
                )
        except UpstreamError as e:  # P computes the prefix: nothing is lost
            logger.info("no prefix lent by %s: %s", decode.url, e.message)
            self.metrics.reverse_pulls.labels("failed").inc()
            return None
        lent = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(lent, dict):
            self.metrics.reverse_pulls.labels("nothing_cached").inc()
            return None
        self.metrics.reverse_pulls.labels("lent").inc()
        num_tokens = answer.get("num_tokens")
        return Lent(lent, num_tokens if isinstance(num_tokens, int) else 0)

    async def _reserve(self, req: ProxyRequest, decode: Worker) -> dict | None:
        """Push: blocks on D for the prompt; None (pull instead) when D cannot spare them."""
        try:
            with self.calls.span(req, "proxy.reserve", decode):
                return await post_json(
                    decode, "/internal/kv/reserve", req.reserve_body(), self.calls.internal,
                    self.calls.internal_timeout,
                )  # fmt: skip
        except UpstreamError as e:
            if e.is_client_error:
                raise UpstreamAPIError(e) from e
            logger.warning("reservation failed, pulling instead: %s", e.message)
            return None

    def give_back(self, prefilled: Prefilled | None) -> None:
        """Free what a request that will not be decoded holds on P (pull) or D (push)."""
        if prefilled is None:
            return
        if prefilled.push_to is not None:
            assert prefilled.reserved_on is not None, "a push reservation names its D"
            reservation = {"reservation_id": prefilled.push_to["reservation_id"]}
            self.calls.release(prefilled.reserved_on, reservation)
        elif rid := prefilled.params.get("remote_request_id"):
            self.calls.release(prefilled.worker, {"request_id": rid})
