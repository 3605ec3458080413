"""The proxy's view of its workers: one `Worker` per upstream URL, two `WorkerPool`s (P and D).

Each worker has its own `httpx.AsyncClient` (keep-alive connections to that worker only), a
count of outstanding requests (for routing), and a health state that active checks and passive
ejection move. A draining worker takes no new requests; its running ones finish. `source` says
where it came from: `static` (the command line or config file), `admin` (the admin API), or the
`dns://NAME:PORT` entry whose resolution found it (proxy/discovery.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

ROLES = ("prefill", "decode")


@dataclass(eq=False)  # a worker is itself: compared and hashed by identity
class Worker:
    url: str
    role: str
    client: httpx.AsyncClient  # health checks, admin calls, /v1/models
    transport: httpx.AsyncBaseTransport  # the client's; the request path sends through it
    is_healthy: bool = False  # until the first health check passes
    is_draining: bool = False
    num_outstanding: int = 0
    num_failures: int = 0  # consecutive failed checks
    num_successes: int = 0  # consecutive good checks
    last_error: str | None = None
    num_ejections: int = 0  # times it went from healthy to not (checks or a failed request)
    source: str = "static"
    changed_at: float = field(default_factory=time.monotonic)
    _endpoints: dict[str, httpx.URL] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> httpx.URL:
        """The absolute URL of `path` on this worker (parsed once: httpx's URL merging costs)."""
        url = self._endpoints.get(path)
        if url is None:
            url = self._endpoints[path] = httpx.URL(self.url + path)
        return url

    @property
    def is_routable(self) -> bool:
        return self.is_healthy and not self.is_draining

    def eject(self, why: str) -> None:
        """Passive ejection: a request could not reach it. Health checks readmit it."""
        self.last_error = why
        self.num_successes = 0
        if self.is_healthy:
            self.is_healthy = False
            self.num_ejections += 1
            self.changed_at = time.monotonic()

    def record_check(self, ok: bool, why: str | None, failures: int, successes: int) -> bool:
        """One active check's result; True when the health state flipped."""
        if ok:
            self.num_successes += 1
            self.num_failures = 0
        else:
            self.num_failures += 1
            self.num_successes = 0
            self.last_error = why
        flip = (not self.is_healthy and ok and self.num_successes >= successes) or (
            self.is_healthy and not ok and self.num_failures >= failures
        )
        if flip:
            self.is_healthy = not self.is_healthy
            self.changed_at = time.monotonic()
            if self.is_healthy:
                self.last_error = None
            else:
                self.num_ejections += 1
        return flip

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.is_healthy,
            "draining": self.is_draining,
            "outstanding": self.num_outstanding,
            "last_error": self.last_error,
            "source": self.source,
        }


class WorkerPool:
    """The workers of one role, in the order they were added."""

    def __init__(self, role: str):
        assert role in ROLES, role
        self.role = role
        self.workers: list[Worker] = []

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, url: str) -> Worker | None:
        url = normalize_url(url)
        return next((w for w in self.workers if w.url == url), None)

    def add(self, worker: Worker) -> None:
        assert self.get(worker.url) is None, f"{worker.url} is already a {self.role} worker"
        self.workers.append(worker)

    def remove(self, url: str) -> Worker | None:
        worker = self.get(url)
        if worker is not None:
            self.workers.remove(worker)
        return worker

    def routable(self, exclude: tuple[Worker, ...] = ()) -> list[Worker]:
        return [w for w in self.workers if w.is_routable and w not in exclude]

    @property
    def num_healthy(self) -> int:
        return sum(w.is_healthy for w in self.workers)


class FailedWorkers:
    """The workers that failed one request, each kept out of its way until it comes back: a
    health flip after its failure (a restarted worker is a new one)."""

    def __init__(self) -> None:
        self._at: dict[Worker, float] = {}
        self.num_failures = 0

    def add(self, worker: Worker) -> None:
        self._at[worker] = time.monotonic()
        self.num_failures += 1

    @property
    def excluded(self) -> tuple[Worker, ...]:
        return tuple(w for w, at in self._at.items() if w.changed_at <= at)


def normalize_url(url: str) -> str:
    return url.rstrip("/")


def check_worker_url(url: str) -> str:
    """`url`, normalized; ValueError unless it is http(s)://host[:port][/path]. NOTE: a host
    name IDNA cannot encode fails each health check with a UnicodeError, which stops the checker."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port == 0:
            raise ValueError("expected http(s)://host[:port][/path]")
        if parts.query or parts.fragment or any(c.isspace() for c in url):
            raise ValueError("no query, fragment or white space")
        parts.hostname.encode("idna")  # UnicodeError (a ValueError): e.g. a label too long
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        raise ValueError(f"not a worker URL: {url!r} ({e})") from None
    return normalize_url(url)
