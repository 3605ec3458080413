"""Routing policies: which worker of a pool serves the next request.

Each policy is a small class with `choose(workers, key)`; `POLICIES` is the registry the config
names. `workers` are the routable ones (healthy, not draining, not already tried), never empty;
`key` is the prompt's leading characters, used only by prefix-aware routing.

`prefix` is the hash fallback of exact KV-aware routing: where workers publish KV events, the
proxy routes by the blocks they really hold (proxy/kv_routing.py) and asks these policies only
to break ties.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from abc import ABC, abstractmethod

from proxy.workers import Worker

LOAD_FACTOR = 1.25  # how far above the average (or the best) a worker's load may be and still win


def load_bound(workers: list[Worker], load_factor: float = LOAD_FACTOR) -> float:
    """The most requests in flight, the next one included, a worker of `workers` may carry and
    still take the next: `load_factor` × their average with it, at least 1 (bounded-load
    consistent hashing). A worker is within it when `num_outstanding + 1 <= load_bound`."""
    total = sum(w.num_outstanding for w in workers) + 1
    return max(1.0, load_factor * total / len(workers))


class RoutingPolicy(ABC):
    @abstractmethod
    def choose(self, workers: list[Worker], key: str) -> Worker: ...


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[Worker], key: str) -> Worker:
        return workers[next(self._counter) % len(workers)]


class LeastOutstanding(RoutingPolicy):
    """The worker with the fewest requests in flight; ties go round robin."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[Worker], key: str) -> Worker:
        start = next(self._counter) % len(workers)
        rotated = workers[start:] + workers[:start]
        return min(rotated, key=lambda w: w.num_outstanding)


class PowerOfTwo(RoutingPolicy):
    """Two workers at random, the less loaded of them (Mitzenmacher's power of two choices)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: list[Worker], key: str) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.num_outstanding <= b.num_outstanding else b


class PrefixAware(RoutingPolicy):
    """Consistent hashing of the prompt's leading characters with bounded loads: prompts that
    share a prefix go to the same prefill worker (whose prefix cache then hits), unless that
    worker already carries more than `load_factor` × the average load (then the next on the ring).
    """

    VNODES = 64

    def __init__(self, load_factor: float = LOAD_FACTOR) -> None:
        self.load_factor = load_factor
        self._rings: dict[tuple[int, ...], tuple[list[int], list[Worker]]] = {}

    def choose(self, workers: list[Worker], key: str) -> Worker:
        points, owners = self._ring(workers)
        bound = load_bound(workers, self.load_factor)
        start = bisect.bisect(points, _hash(key)) % len(points)
        for i in range(len(points)):
            worker = owners[(start + i) % len(points)]
            if worker.num_outstanding + 1 <= bound:
                return worker
        return min(workers, key=lambda w: w.num_outstanding)

    def _ring(self, workers: list[Worker]) -> tuple[list[int], list[Worker]]:
        ids = tuple(id(w) for w in workers)
        ring = self._rings.get(ids)
        if ring is None:
            nodes = [(_hash(f"{w.url}#{i}"), w) for w in workers for i in range(self.VNODES)]
            nodes.sort(key=lambda node: node[0])
            ring = [p for p, _ in nodes], [w for _, w in nodes]
            if len(self._rings) > 64:  # pool changes are rare; keep the cache small
                self._rings.clear()
            self._rings[ids] = ring
        return ring


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "prefix": PrefixAware,
}


def create_policy(name: str) -> RoutingPolicy:
    return POLICIES[name]()
