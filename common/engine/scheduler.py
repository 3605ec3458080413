"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, in arrival
order: each gets the tokens it still lacks (1 when decoding; the rest of its prompt, chunked to
the budget, when prefilling). When the pool has no block for one, the newest running request is
preempted: its blocks are freed (full ones stay in the prefix cache) and it waits at the head
of the queue to be recomputed. Then waiting requests are admitted while budget, blocks and
`max_num_seqs` allow, starting from their longest cached prefix.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.engine.request import Request, RequestStatus
from common.engine.sampler import SampledToken
from common.kv_cache.manager import KVCacheManager
from common.kv_transfer.base import KVConnector


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        connector: KVConnector | None = None,
    ):
        self.cfg = cfg
        self.connector = connector
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None):
        """End a request (stop, length or abort) and free its blocks."""
        assert status.is_finished, status
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.stop_reason = status, stop_reason
        if self.connector is None or not self.connector.request_finished(req):
            self.kv.free(req)

    def fail(self, req: Request, error: str) -> None:
        """End a request with an error for its client (its remote KV was lost: kv_transfer)."""
        req.error = error
        self.finish(req, RequestStatus.FINISHED_ERROR)

    def stop_if_done(self, req: Request, token_id: int) -> bool:
        """Finish `req` if `token_id`, its newest token, ends it; True if it did."""
        if req.grammar is not None and req.grammar.error is not None:
            req.error_is_request_fault = True
            self.fail(req, req.grammar.error)
            return True
        status, reason = self.check_stop(req, token_id)
        if status is not None:
            self.finish(req, status, reason)
        return status is not None

    def recompute(self, req: Request) -> None:
        """Computed again, locally, from token 0: a running request goes back to the head of
        the queue with no KV; one never admitted (its pushed KV was lost) joins the tail."""
        if req not in self.running:
            return self.add_request(req)
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.cfg.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            preloaded = bool(req.blocks)  # pushed KV: blocks and computed count are set
            if preloaded:
                computed, num_cached, num_external = [], 0, 0
                num_new = req.num_uncomputed_tokens
            else:
                computed, num_cached = self.kv.get_computed_blocks(req)
                num_external = self._num_external(req, num_cached)
                num_new = req.num_tokens - num_cached - num_external
            if num_new > budget and not self.cfg.enable_chunked_prefill:
                return
            num_new = min(num_new, budget)
            if not preloaded:
                req.num_computed_tokens = num_cached + num_external
            if not self.kv.allocate_slots(req, num_new, computed):
                if not preloaded:
                    req.num_computed_tokens = 0
                return
            if self.connector is not None:
                self.connector.after_allocation(req, num_cached)
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_cached
                req.times.scheduled_ns = req.times.scheduled_ns or time.time_ns()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def _num_external(self, req: Request, num_cached: int) -> int:
        """Tokens whose KV comes from another worker (computed elsewhere, loaded this step)."""
        return 0 if self.connector is None else self.connector.num_external_tokens(req, num_cached)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- update -------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish stopped requests.

        Returns the requests that got a token this step (finished ones included).
        """
        changed = []
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            self.stop_if_done(req, token.token_id)
            changed.append(req)
        return changed

    def check_stop(self, req: Request, token_id: int):
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if req.grammar is not None and req.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED, None  # the grammar admits nothing more
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
