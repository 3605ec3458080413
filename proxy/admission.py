"""Admission control: whether a request may start now, and in what order waiting ones start.

- **Rate limits.** A token bucket per API key (the `Authorization: Bearer KEY`; requests with
  no key share the key `anonymous`): `--rate-limit KEY=RPS[:BURST]`, and `default=RPS[:BURST]`
  for every key not listed (each its own bucket). Off unless given. The buckets are an LRU of
  at most `MAX_BUCKETS`: a new key past it drops the least recently used bucket, in O(1).
- **Concurrency.** At most `--max-concurrency` requests hold a slot, from admission until their
  response has been sent (or the client left); 0 is no limit. The others wait in one bounded
  queue (`--max-queue`), each for at most `--queue-timeout` seconds, highest class first, then
  by arrival. A client that leaves while queued leaves the queue.
- **Priority classes.** `X-Priority: high|normal|low`. A key listed in `--key-priority
  KEY=CLASS` defaults to that class and cannot ask for a higher one; `default=CLASS` does the
  same for every key not listed (requests without a key included, unless `anonymous` is
  listed); with no `default`, other keys default to `normal` and may ask for any class.

Every refusal is a 429 in OpenAI's shape (`type` `rate_limit_error`, `code` `rate_limited`,
`queue_full` or `queue_timeout`) with `Retry-After`: the retry that OpenAI's clients make on
their own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response

from common.api.errors import APIError, InvalidRequestError, OverloadedError

PRIORITIES = ("high", "normal", "low")  # a class's rank is its index: lower starts first
DEFAULT_KEY = "default"  # --rate-limit default=...: every key not listed
ANONYMOUS_KEY = "anonymous"  # requests without a key
MAX_BUCKETS = 10_000  # past this, the least recently used bucket is dropped


@dataclass(frozen=True)
class RateLimit:
    rps: float  # tokens added per second
    burst: float  # the bucket's size

    def __post_init__(self) -> None:
        if not (self.rps > 0 and self.burst >= 1):
            raise ValueError(f"a rate limit needs RPS > 0 and BURST >= 1, got {self}")

    @classmethod
    def parse(cls, spec: str) -> RateLimit:
        """`RPS[:BURST]`; the burst defaults to one second's worth (at least 1)."""
        rps, _, burst = spec.partition(":")
        try:
            return cls(float(rps), float(burst) if burst else max(1.0, float(rps)))
        except ValueError as e:
            raise ValueError(f"bad rate limit {spec!r} (RPS[:BURST]): {e}") from e


def parse_assignments(specs: tuple[str, ...], flag: str) -> dict[str, str]:
    """`KEY=VALUE` strings as a dict. The last `=` splits: base64 keys may end in `=`."""
    pairs = {}
    for spec in specs:
        key, sep, value = spec.rpartition("=")
        if not (sep and key and value):
            raise ValueError(f"{flag} takes KEY=VALUE, got {spec!r}")
        pairs[key] = value
    return pairs


def parse_rate_limits(specs: tuple[str, ...]) -> dict[str, RateLimit]:
    pairs = parse_assignments(specs, "--rate-limit")
    return {key: RateLimit.parse(value) for key, value in pairs.items()}


def parse_key_priorities(specs: tuple[str, ...]) -> dict[str, int]:
    pairs = parse_assignments(specs, "--key-priority")
    for value in pairs.values():
        if value not in PRIORITIES:
            raise ValueError(f"--key-priority classes are {PRIORITIES}, got {value!r}")
    return {key: PRIORITIES.index(value) for key, value in pairs.items()}


class AdmissionRefused(OverloadedError):
    """A 429 with `Retry-After`; `code` is the reason, also the metric's label."""

    def __init__(self, message: str, code: str, retry_after_s: float):
        retry = str(max(1, math.ceil(retry_after_s)))
        super().__init__(message, code=code, headers={"Retry-After": retry})


class ClientGoneError(APIError):
    """The client left while its request was queued: nobody reads this answer."""

    status_code = 499
    error_type = "client_closed_request"


class TokenBucket:
    def __init__(self, limit: RateLimit, now: float):
        self.limit = limit
        self.tokens = limit.burst
        self.stamp = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 when there was one, else the seconds until there will be."""
        self._refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.limit.rps

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)
        self.tokens = min(self.limit.burst, self.tokens + elapsed * self.limit.rps)
        self.stamp = now


class RateLimiter:
    """A token bucket per key; keys with no limit (and no default) are never counted. At most
    `max_buckets` buckets, least recently used first out: a dropped key starts again full."""

    def __init__(
        self,
        limits: dict[str, RateLimit],
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int = MAX_BUCKETS,
    ):
        assert max_buckets > 0, "a rate limiter needs room for one bucket"
        self.limits = limits
        self.clock = clock
        self.max_buckets = max_buckets
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently used first

    def wait_s(self, key: str) -> float:
        """0.0 if `key` may send a request now (a token is taken), else seconds to wait."""
        limit = self.limits.get(key) or self.limits.get(DEFAULT_KEY)
        if limit is None:
            return 0.0
        now = self.clock()
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.max_buckets:
                self.buckets.popitem(last=False)
            bucket = self.buckets[key] = TokenBucket(limit, now)
        else:
            self.buckets.move_to_end(key)
        return bucket.take(now)


class Slot:
    """One request's place among the running ones; `release` is idempotent."""

    def __init__(self, queue: SlotQueue):
        self._queue = queue
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._queue.hand_on()


class SlotQueue:
    """At most `max_running` slots held; up to `max_waiting` requests wait for one, by class
    then arrival, each for at most `timeout` seconds. A freed slot passes straight to the first
    waiter, so a newcomer never overtakes the queue. A waiter that leaves (its deadline passed
    or its client left) is swept from the heap once the leavers outnumber the waiters, so the
    heap holds at most `2 * max_waiting` entries."""

    def __init__(self, max_running: int, max_waiting: int, timeout: float):
        assert max_running > 0, "a SlotQueue bounds the running requests"
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.num_running = 0
        self.num_waiting = 0
        self.num_left = 0  # entries of waiters that left, still in the heap
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def heap_size(self) -> int:
        """Entries in the heap: `num_waiting` live ones and `num_left` not yet swept."""
        return len(self._heap)

    async def acquire(self, rank: int) -> Slot:
        if self.num_running < self.max_running and self.num_waiting == 0:
            self.num_running += 1
            return Slot(self)
        if self.num_waiting >= self.max_waiting:
            raise AdmissionRefused(
                f"the proxy's queue is full ({self.max_waiting} requests waiting); retry later",
                "queue_full",
                1,
            )
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._arrivals), granted))
        self.num_waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            if granted.done():  # granted as the deadline passed or the client left
                if isinstance(e, TimeoutError):
                    return Slot(self)
                Slot(self).release()
                raise
            granted.cancel()
            self._leave()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise AdmissionRefused(
                f"no capacity within {self.timeout:g} s in the proxy's queue; retry later",
                "queue_timeout",
                1,
            ) from None
        return Slot(self)

    def hand_on(self) -> None:
        """A slot is free: to the first live waiter, else back to the pool."""
        while self._heap:
            _, _, granted = heapq.heappop(self._heap)
            if granted.done():  # a waiter that left
                self.num_left -= 1
                continue
            self.num_waiting -= 1
            granted.set_result(None)
            return
        self.num_running -= 1
        assert self.num_running >= 0, "a slot was released twice"

    def _leave(self) -> None:
        """A waiter left; its entry, now done, stays until `hand_on` pops it or a sweep."""
        self.num_waiting -= 1
        self.num_left += 1
        if self.num_left > self.num_waiting:  # amortised O(1) a leaver: a sweep halves the heap
            self._heap = [entry for entry in self._heap if not entry[2].done()]
            heapq.heapify(self._heap)
            self.num_left = 0
        assert len(self._heap) == self.num_waiting + self.num_left, "a lost heap entry"


class HeldResponse(Response):
    """`inner`, sent as is; `on_sent` runs once it has been sent or the client left (the
    request's slot released, its trace ended)."""

    def __init__(self, inner: Response, on_sent: Callable[[], None]):
        self.inner = inner
        self.on_sent = on_sent
        self.status_code = inner.status_code
        self.background = None
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.on_sent()


class Admission:
    """The proxy's admission: the rate limiter, the slot queue, the priority of a request."""

    def __init__(self, cfg, metrics, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.limiter = RateLimiter(cfg.rate_limits, clock)
        self.key_ranks = cfg.key_priorities
        self.queue = None
        if cfg.max_concurrency > 0:
            self.queue = SlotQueue(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout)
            metrics.queue_depth.set_function(lambda: self.queue.num_waiting)
            metrics.admitted_running.set_function(lambda: self.queue.num_running)

    def check_rate(self, key: str | None) -> None:
        wait_s = self.limiter.wait_s(key or ANONYMOUS_KEY)
        if wait_s > 0:
            self._refused("rate_limited")
            raise AdmissionRefused(
                "rate limit reached for this API key; retry later", "rate_limited", wait_s
            )

    def rank_of(self, key: str | None, header: str | None) -> int:
        """The request's class: `X-Priority`, capped by its key's `--key-priority` (or by
        `default=CLASS` for a key not listed)."""
        ranks = self.key_ranks
        ceiling = ranks.get(key or ANONYMOUS_KEY, ranks.get(DEFAULT_KEY))
        if header is None:
            return PRIORITIES.index("normal") if ceiling is None else ceiling
        asked = header.strip().lower()
        if asked not in PRIORITIES:
            raise InvalidRequestError(f"X-Priority must be one of {PRIORITIES}, got {header!r}")
        return max(PRIORITIES.index(asked), ceiling or 0)

    async def enter(self, rank: int, until_gone: Callable[[], Awaitable]) -> Slot | None:
        """A slot (None when there is no limit); waits in the queue while the client stays
        (`until_gone()` returns when it leaves)."""
        if self.queue is None:
            return None
        started = time.perf_counter()
        waiter = asyncio.ensure_future(self.queue.acquire(rank))
        gone = asyncio.ensure_future(until_gone())
        try:
            await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
        if waiter.cancelled():
            self.metrics.disconnects.inc()
            raise ClientGoneError("the client left while its request was queued")
        if isinstance(waiter.exception(), AdmissionRefused):
            self._refused(waiter.exception().code)
        slot = waiter.result()
        self.metrics.queue_wait.observe(time.perf_counter() - started)
        return slot

    def _refused(self, reason: str) -> None:
        self.metrics.admission_rejected.labels(reason).inc()
