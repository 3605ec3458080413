"""The plan: which D decodes a request, and whether P computes its prompt first (and how the KV
reaches D) or D computes it alone. One rule for a new request and for every move of one
(migration.py plans a move as a new request whose prompt is the token ids so far): the same
request and the same state give the same plan.

- **D.** Where workers publish KV events, the D holding the most of the prompt's blocks, its
  token ids rendered first (proxy/kv_routing.py); elsewhere the pool's policy. A session keeps
  its worker (proxy/sessions.py). A move leaves out the D's that failed the request.
- **The path.** Disaggregated (P then D) unless the mode is colocated, the prompt is short
  (`min_disagg_tokens`, estimated: a prompt of token ids, every move's, is counted exactly), it
  is a batch of prompts, no P is routable, or D already holds all of the prompt but a few
  tokens (`cached_on_decode_tokens`): then D alone. Disaggregated, the mode says how the KV
  reaches D: D reads it from P (pull), or P writes it into blocks D reserved (push).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.api.errors import UnavailableError
from proxy.config import ProxyConfig
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.policies import create_policy
from proxy.request import ProxyRequest
from proxy.sessions import SessionAffinity
from proxy.workers import Worker, WorkerPool

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"


@dataclass(frozen=True)
class Plan:
    decode: Worker  # the D that decodes (and holds the push reservation)
    path: str  # DISAGGREGATED or COLOCATED
    reason: str  # disaggregated: the mode ("pull", "push"); colocated: why D computes it alone
    token_ids: list[int] | None = None  # the prompt's, where workers' KV events route it

    @property
    def is_disaggregated(self) -> bool:
        return self.path == DISAGGREGATED

    @property
    def is_push(self) -> bool:
        return self.is_disaggregated and self.reason == "push"


class Planner:
    def __init__(
        self,
        cfg: ProxyConfig,
        pools: dict[str, WorkerPool],
        kv: KVRouter,
        metrics: ProxyMetrics,
    ):
        self.cfg = cfg
        self.pools = pools
        self.kv = kv
        self.policies = {
            "prefill": create_policy(cfg.prefill_policy),
            "decode": create_policy(cfg.decode_policy),
        }
        self.sessions = {r: SessionAffinity(r, metrics, cfg.max_sessions) for r in self.policies}

    async def plan(
        self, req: ProxyRequest, exclude: tuple[Worker, ...] = (), wait: bool = False
    ) -> Plan:
        """`req`'s plan; `exclude`: D's that failed it; `wait`: for a D about to come back
        (`choose_soon`), as a move does. UnavailableError when no D is routable."""
        token_ids = await self.kv.prompt_tokens(req)  # None: no worker's KV events to route by
        if wait:
            decode = await self.choose_soon("decode", req, exclude, token_ids)
        else:
            decode = self.choose("decode", req, exclude, token_ids)
        path, reason = self.path(req, decode, token_ids)
        return Plan(decode, path, reason, token_ids)

    def path(
        self, req: ProxyRequest, decode: Worker, token_ids: list[int] | None
    ) -> tuple[str, str]:
        if self.cfg.mode == "colocated":
            return COLOCATED, "mode"
        if req.is_batch:
            return COLOCATED, "batch"
        if not self.pools["prefill"].routable():
            return COLOCATED, "no_prefill"
        if self.cfg.min_disagg_tokens and req.estimated_tokens() < self.cfg.min_disagg_tokens:
            return COLOCATED, "short_prompt"
        if token_ids is not None and self.kv.is_cached_on(decode, token_ids):
            return COLOCATED, "cached_on_decode"
        return DISAGGREGATED, self.cfg.mode

    def choose(
        self,
        role: str,
        req: ProxyRequest,
        tried: tuple[Worker, ...] = (),
        token_ids: list[int] | None = None,
    ) -> Worker:
        workers = self.pools[role].routable(exclude=tried)
        if not workers:
            raise UnavailableError(f"no healthy {role} worker", headers={"Retry-After": "1"})
        key = req.prompt_text[: self.cfg.prefix_chars]

        def by_prompt() -> Worker:
            if token_ids is not None:
                return self.kv.choose(role, workers, token_ids, self.policies[role], key)
            return self.policies[role].choose(workers, key)

        if req.session_id is not None and self.cfg.session_affinity:
            return self.sessions[role].choose(req.session_id, workers, by_prompt)
        return by_prompt()

    async def choose_soon(
        self,
        role: str,
        req: ProxyRequest,
        exclude: tuple[Worker, ...] = (),
        token_ids: list[int] | None = None,
    ) -> Worker:
        """A worker for a request that moves (its D failed): when none is routable, one may be
        about to come back (the last of a rolling restart), so wait the time the health checks
        take to readmit one before UnavailableError."""
        health = self.cfg.health
        wait_until = time.monotonic() + health.interval * (health.success_threshold + 1)
        while True:
            try:
                return self.choose(role, req, exclude, token_ids)
            except UnavailableError:
                if time.monotonic() >= wait_until:
                    raise
                await asyncio.sleep(0.1)
