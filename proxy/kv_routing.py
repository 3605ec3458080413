"""Routing by the KV blocks workers really hold (their KV events), hashing as the fallback.

For a request, when a pool it may use has a worker with events (proxy/kv_events.py):

1. **The prompt's token ids.** A completions prompt of token ids is used as is; any other
   prompt is rendered by one worker (vLLM's `POST /v1/completions/render` or
   `/v1/chat/completions/render`, the ids that generation prefills, chat template included), so
   the proxy loads no tokenizer and no model; `pdserve_proxy_render_seconds` is that cost. A
   failed render routes the request as if no worker had events.
2. **Prefill** (`--prefill-policy prefix`): a worker's cost is the prompt tokens it must compute
   before this prompt's first token: the uncached tokens of the prefills this proxy has in
   flight on it, plus this prompt's tokens beyond the prefix it holds. Prefills in flight count
   as held for prompts that share their leading blocks (they are cached by the time a
   request queued behind them runs); an index of their blocks (proxy/kv_index.py) makes that
   one walk of the prompt, however many prefills are in flight. Of the workers within
   `LOAD_FACTOR` × the lowest cost, the one holding the longest prefix wins: the cache wins
   unless the queue in front of it costs clearly more than the cache saves. Ties (a prefix
   nobody holds) go to the hash policy, so that the requests of a new prefix meet on one
   worker.
3. **Decode**: D's load is requests, not tokens: of the workers within PrefixAware's bound on
   requests in flight, the one holding the longest prefix; ties go to `--decode-policy`. A D
   that holds all of the prompt but fewer than `--cached-on-decode-tokens` serves it alone
   (`routed_total{path="colocated",reason="cached_on_decode"}`): computing the rest costs it
   less than a transfer. Disaggregated, D already reads only what its own cache lacks.
4. **The reverse pull** (`reverse_gain`): when the chosen D holds a longer prefix of the prompt
   than P (an earlier turn's answer, which D generated and P never saw) by at least
   `--reverse-pull-min-tokens`, P reads those blocks from D instead of computing them
   (proxy/journey/prefill.py leases them on D first).

A request with a `cache_salt` shares blocks only with its salt's: it is routed as if no worker
had events (`kv_fallbacks_total{reason="cache_salt"}`), so no hit is ever claimed across salts.

`pdserve_proxy_prefix_hit_blocks{role}` counts the prompt blocks the chosen worker held, by its
events; `pdserve_proxy_prefix_query_blocks{role}` the prompt's full blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from proxy.config import ProxyConfig
from proxy.kv_events import KVEventFeeds
from proxy.kv_index import InFlightPrefixes
from proxy.metrics import ProxyMetrics
from proxy.policies import LOAD_FACTOR, RoutingPolicy, load_bound
from proxy.request import ProxyRequest
from proxy.upstream import UpstreamError, post_json
from proxy.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

RENDER_PATHS = {False: "/v1/completions/render", True: "/v1/chat/completions/render"}


class KVRouter:
    def __init__(
        self,
        cfg: ProxyConfig,
        pools: dict[str, WorkerPool],
        feeds: KVEventFeeds,
        metrics: ProxyMetrics,
    ):
        self.cfg = cfg
        self.pools = pools
        self.feeds = feeds
        self.metrics = metrics
        self._timeout = httpx.Timeout(5.0, connect=cfg.connect_timeout)
        self._prefills: dict[Worker, InFlightPrefixes] = {}  # in flight, by this proxy

    # -- the prompt's tokens ------------------------------------------------------------------
    async def prompt_tokens(self, req: ProxyRequest) -> list[int] | None:
        """The prompt's token ids when some pool routes by cache; None otherwise."""
        if not self.cfg.kv_routing or req.is_batch or not self._has_events(req):
            return None
        if req.body.get("cache_salt") is not None:
            # NOTE: the stages after this one know a prompt by its tokens alone, not its salt
            # (the indexes root salted chains apart: kv_index.py); routed as a prompt nobody
            # holds, it never claims another salt's blocks nor asks D to lend them
            self.metrics.kv_fallbacks.labels("cache_salt").inc()
            return None
        prompt = req.body.get("prompt")
        if not req.is_chat and isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt or None
        return await self._render(req)

    def _has_events(self, req: ProxyRequest) -> bool:
        roles = ["decode"]
        if self.cfg.mode != "colocated" and self.cfg.prefill_policy == "prefix":
            roles.append("prefill")
        workers = [w for role in roles for w in self.pools[role].routable()]
        return any(self.feeds.index_of(w) is not None for w in workers)

    async def _render(self, req: ProxyRequest) -> list[int] | None:
        workers = self.pools["prefill"].routable() + self.pools["decode"].routable()
        worker = min(workers, key=lambda w: w.num_outstanding)
        started = time.perf_counter()
        try:
            answer = await post_json(worker, RENDER_PATHS[req.is_chat], req.body, {}, self._timeout)
        except UpstreamError as e:
            logger.info("render failed, routing without the cache: %s", e.message)
            self.metrics.kv_fallbacks.labels("render_failed").inc()
            return None
        finally:
            self.metrics.render_seconds.observe(time.perf_counter() - started)
        item = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
        ids = item.get("token_ids") if isinstance(item, dict) else None
        if not isinstance(ids, list) or not ids:
            self.metrics.kv_fallbacks.labels("render_failed").inc()
            return None
        return ids

    # -- choices -------------------------------------------------------------------------------
    def choose(
        self,
        role: str,
        workers: list[Worker],
        token_ids: list[int],
        fallback: RoutingPolicy,
        key: str,
    ) -> Worker:
        """The worker for this prompt; `fallback` (the pool's policy) where no worker of
        `workers` has events, and among equals."""
        indexes = {w: index for w in workers if (index := self.feeds.index_of(w)) is not None}
        held = {w: index.match(token_ids) for w, index in indexes.items()}
        if not held:
            self.metrics.kv_fallbacks.labels("no_events").inc()
            worker = fallback.choose(workers, key)
        elif role == "decode":
            worker = self._choose_decode(workers, held, fallback, key)
        elif self.cfg.prefill_policy == "prefix":
            worker = self._choose_prefill(workers, token_ids, held, fallback, key)
        else:
            worker = fallback.choose(workers, key)
        self._count(role, worker, token_ids, held.get(worker, 0))
        return worker

    def _choose_prefill(self, workers, token_ids, held, fallback, key) -> Worker:
        cached = {w: self._cached_tokens(w, token_ids, held.get(w, 0)) for w in workers}
        cost = {w: self._queued(w) + len(token_ids) - cached[w] for w in workers}
        bound = LOAD_FACTOR * min(cost.values())
        eligible = [w for w in workers if cost[w] <= bound]
        most = max(cached[w] for w in eligible)
        return _one_of([w for w in eligible if cached[w] == most], fallback, key)

    def _choose_decode(self, workers, held, fallback, key) -> Worker:
        bound = load_bound(workers)
        eligible = [w for w in workers if w.num_outstanding + 1 <= bound] or workers
        most = max(held.get(w, 0) for w in eligible)
        return _one_of([w for w in eligible if held.get(w, 0) == most], fallback, key)

    def is_cached_on(self, decode: Worker, token_ids: list[int]) -> bool:
        """D holds all of the prompt but fewer than `cached_on_decode_tokens`: D alone."""
        index = self.feeds.index_of(decode)
        limit = self.cfg.cached_on_decode_tokens
        if not self.cfg.kv_routing or not limit or index is None:
            return False
        cached = index.match(token_ids) * index.block_size
        return cached > 0 and len(token_ids) - cached < limit

    def reverse_gain(self, prefill: Worker, decode: Worker, token_ids: list[int]) -> int:
        """The reverse pull's saving: prompt tokens D holds (its events; at most all but the
        last token) beyond those P holds or is computing."""
        index = self.feeds.index_of(decode)
        if not self.cfg.kv_routing or index is None:
            return 0
        usable = (len(token_ids) - 1) // index.block_size
        lent = min(index.match(token_ids), usable) * index.block_size
        own = self.feeds.index_of(prefill)
        held = own.match(token_ids) if own is not None else 0
        return lent - self._cached_tokens(prefill, token_ids, held)

    # -- prefills in flight --------------------------------------------------------------------
    @contextmanager
    def prefilling(self, worker: Worker, token_ids: list[int] | None) -> Iterator[None]:
        """While P computes this prompt: its uncached tokens count as P's queue, its blocks as
        held for prompts that share them."""
        index = self.feeds.index_of(worker) if token_ids else None
        if index is None:
            yield
            return
        held = self._cached_tokens(worker, token_ids, index.match(token_ids))
        prefills = self._prefills.setdefault(worker, InFlightPrefixes(index.block_size))
        entry = prefills.add(token_ids, len(token_ids) - held)
        try:
            yield
        finally:
            prefills.remove(entry)
            if not prefills:
                del self._prefills[worker]

    def _queued(self, worker: Worker) -> int:
        prefills = self._prefills.get(worker)
        return 0 if prefills is None else prefills.num_uncached

    def _cached_tokens(self, worker: Worker, token_ids: list[int], held: int) -> int:
        """Tokens of the prompt's prefix the worker holds (`held` blocks) or is computing."""
        index = self.feeds.index_of(worker)
        if index is None:
            return 0
        prefills = self._prefills.get(worker)
        is_comparable = prefills is not None and prefills.block_size == index.block_size
        computing = prefills.match(token_ids) if is_comparable else 0  # O(prompt blocks)
        return max(held, computing) * index.block_size

    def _count(self, role: str, worker: Worker, token_ids: list[int], held: int) -> None:
        index = self.feeds.index_of(worker)
        if index is not None:
            self.metrics.prefix_hit_blocks.labels(role).inc(held)
            self.metrics.prefix_query_blocks.labels(role).inc(len(token_ids) // index.block_size)


def _one_of(tied: list[Worker], fallback: RoutingPolicy, key: str) -> Worker:
    return tied[0] if len(tied) == 1 else fallback.choose(tied, key)
