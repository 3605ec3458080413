"""Session affinity: the requests of one conversation (the client's `X-Session-ID`) go to the
worker that served its last one, whose cache holds the conversation so far. One instance per pool:
D holds the conversation's KV, P's prefix cache the earlier prompts.

For a request with a session id, of the workers it may use (routable, those a retry already
tried left out):

1. **kept**: the worker that served the session's last request, if it is among them and within
   the load bound (`policies.load_bound`, the bound of prefix hashing and KV-aware decode), so a
   busy session cannot pin a saturated worker.
2. **hashed**: a session this process has not seen (a new one, or one that another proxy process
   served, or one forgotten): the worker that a rendezvous (highest random weight) hash of the
   session id and the workers' URLs ranks first, so every proxy process picks the same one;
   taken while within the bound.
3. Otherwise the request's usual choice (KV-aware, else the pool's policy):
   `moved_gone` when the remembered worker is not among them (removed, unhealthy, draining, or
   already tried), `moved_load` when the kept or hashed one is over the bound.

The worker chosen is remembered for the session, by URL (a worker started again on the same URL
keeps its sessions), in an LRU of `max_sessions` sessions: the least recent are forgotten.
`pdserve_proxy_session_routed_total{role, outcome}` counts the outcomes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from proxy.metrics import ProxyMetrics
from proxy.policies import load_bound
from proxy.workers import Worker


class SessionAffinity:
    def __init__(self, role: str, metrics: ProxyMetrics, max_sessions: int = 100_000):
        assert max_sessions >= 1, f"max_sessions must be >= 1, got {max_sessions}"
        self.role = role
        self.metrics = metrics
        self.max_sessions = max_sessions
        self._urls: OrderedDict[str, str] = OrderedDict()  # session id → its last worker's URL

    def __len__(self) -> int:
        return len(self._urls)

    def url_of(self, session_id: str) -> str | None:
        """The URL of the worker that served the session's last request, if remembered."""
        return self._urls.get(session_id)

    def choose(
        self, session_id: str, workers: list[Worker], otherwise: Callable[[], Worker]
    ) -> Worker:
        """The session's worker among `workers` (never empty); `otherwise()` is the choice
        the request gets without a session."""
        assert workers, "choose from at least one worker"
        worker, outcome = self._preferred(session_id, workers)
        if worker is None:
            worker = otherwise()
        elif worker.num_outstanding + 1 > load_bound(workers):
            worker, outcome = otherwise(), "moved_load"
        self._remember(session_id, worker)
        self.metrics.session_routed.labels(self.role, outcome).inc()
        return worker

    def _preferred(self, session_id: str, workers: list[Worker]) -> tuple[Worker | None, str]:
        url = self._urls.get(session_id)
        if url is None:
            return max(workers, key=lambda w: _weight(session_id, w.url)), "hashed"
        kept = next((w for w in workers if w.url == url), None)
        return kept, "kept" if kept is not None else "moved_gone"

    def _remember(self, session_id: str, worker: Worker) -> None:
        self._urls[session_id] = worker.url
        self._urls.move_to_end(session_id)
        if len(self._urls) > self.max_sessions:
            self._urls.popitem(last=False)


def _weight(session_id: str, url: str) -> int:
    """The worker's rendezvous weight for the session: the same in every process (no salt)."""
    digest = hashlib.blake2b(f"{session_id}\n{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
