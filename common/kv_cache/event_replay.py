"""Replay requests of the KV events ROUTER, served a few batches at a time under a budget per peer.

A request [start_seq] becomes a job: the buffered batches from start_seq on, then the end
marker. `take(limit)` hands out at most `limit` messages, one per peer in turn, so the publisher
thread sends a short chunk between two looks at its queue of new batches: a flood of replay
requests never holds back publishing. Each peer (a subscriber's host) has a token bucket of
batches (`rate` a second, `burst` at most): a peer out of tokens waits, the others go on. A
peer holds at most `MAX_JOBS_PER_PEER` jobs and at most `MAX_PEERS` peers are tracked; a
request past either is refused (the subscriber's catch-up times out and is tried again later).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_JOBS_PER_PEER = 8  # a host runs one proxy process per core, each catching up on its own
MAX_PEERS = 1024


@dataclass
class _Job:
    client: bytes  # the ROUTER identity to answer
    batches: deque[tuple[int, bytes]]


@dataclass
class _Peer:
    tokens: float
    updated: float
    jobs: deque[_Job] = field(default_factory=deque)


@dataclass(frozen=True)
class ReplayMessage:
    """One message to send: a batch (`seq`, `payload`), or the job's end marker (`seq` None)."""

    client: bytes
    seq: int | None
    payload: bytes = b""


class ReplayQueue:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.num_refused = 0  # requests past a peer's or the queue's limit
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def add(self, peer: str, client: bytes, batches: list[tuple[int, bytes]]) -> bool:
        """Queue a job answering `client` from `peer` with `batches`; False: refused."""
        state = self._peers.get(peer)
        if state is None:
            self._forget_idle()
            if len(self._peers) >= MAX_PEERS:
                self.num_refused += 1
                return False
            state = self._peers[peer] = _Peer(float(self.burst), self.clock())
        if len(state.jobs) >= MAX_JOBS_PER_PEER:
            self.num_refused += 1
            return False
        state.jobs.append(_Job(client, deque(batches)))
        return True

    @property
    def is_due(self) -> bool:
        """Some job can send now."""
        now = self.clock()
        return any(p.jobs and self._refill(p, now) >= 1 or _ends(p) for p in self._peers.values())

    def take(self, limit: int) -> list[ReplayMessage]:
        """Up to `limit` messages, the peers with tokens taking turns."""
        out: list[ReplayMessage] = []
        now = self.clock()
        while len(out) < limit:
            before = len(out)
            for state in self._peers.values():
                if len(out) < limit and state.jobs:
                    message = self._next(state, now)
                    if message is not None:
                        out.append(message)
            if len(out) == before:
                break
        return out

    def _next(self, state: _Peer, now: float) -> ReplayMessage | None:
        job = state.jobs[0]
        if not job.batches:
            state.jobs.popleft()
            return ReplayMessage(job.client, None)
        if self._refill(state, now) < 1:
            return None
        state.tokens -= 1
        seq, payload = job.batches.popleft()
        return ReplayMessage(job.client, seq, payload)

    def _refill(self, state: _Peer, now: float) -> float:
        state.tokens = min(self.burst, state.tokens + (now - state.updated) * self.rate)
        state.updated = now
        return state.tokens

    def _forget_idle(self) -> None:
        """Drop peers with no job whose bucket is full again: they are as good as new."""
        now = self.clock()
        for peer in [p for p, s in self._peers.items() if not s.jobs]:
            if self._refill(self._peers[peer], now) >= self.burst:
                del self._peers[peer]


def _ends(state: _Peer) -> bool:
    """The peer's first job has only its end marker left (free of tokens)."""
    return bool(state.jobs) and not state.jobs[0].batches
