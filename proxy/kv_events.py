"""The proxy's subscriptions to its workers' KV events, each feeding one `BlockIndex`.

A worker says where it publishes at `GET /internal/kv-events` (common/api/internal.py): a
connectable endpoint (null when its events are off), a replay endpoint, topic, block size and
engine id. `KVEventFeeds` asks each healthy worker when it first becomes healthy and again after
every health flip (`Worker.changed_at`), and keeps one `Subscription` per publishing worker:

- a zmq.asyncio SUB socket on the endpoint; batches are applied in sequence order. A worker that
  joins late, or a gap in the sequence (ZMQ's slow joiner, a dropped batch) is caught up from the
  replay endpoint (vLLM's protocol), and so is a quiet stream every `IDLE_CATCH_UP_S`, for the
  last batch of a burst that the live stream lost. Without a replay endpoint a gap is skipped
  and counted: the index may then be stale until the blocks change again.
- a new engine id (a restarted worker: its health checks failed while it was down) starts a
  new subscription with an empty index; `AllBlocksCleared` empties the index. Until the feeds
  have asked the restarted worker, the old subscription ignores its batches whose sequence
  numbers it has seen.

Until a subscription has caught up once, its worker counts as one without events: routing falls
back to hashing (proxy/kv_routing.py). A worker that left the pools loses its subscription.

With CURVE keys in the environment (common/kv_cache/curve_keys.py: the workers' public key and
the proxy's own secret key) both sockets authenticate the worker and are encrypted; the worker
admits the proxy by its public key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from common.kv_cache.curve_keys import CurveClientKeys
from proxy.kv_index import BlockIndex, decode_batch
from proxy.workers import Worker

logger = logging.getLogger(__name__)

EVENTS_PATH = "/internal/kv-events"
SYNC_INTERVAL_S = 0.5  # how often the feeds look for workers that joined or flipped
IDLE_CATCH_UP_S = 1.0  # a stream quiet this long asks the replay endpoint for what it missed
REPLAY_TIMEOUT_MS = 2000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_WILDCARDS = ("*", "[*]", "::", "[::]", "0.0.0.0")


@dataclass(frozen=True)
class EventsSource:
    """Where one worker publishes (its `GET /internal/kv-events`)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    engine_id: str

    @classmethod
    def parse(cls, info: dict, worker_url: str) -> EventsSource | None:
        """None when the worker publishes nowhere a subscriber can connect to. A host the
        worker left a wildcard becomes the host the proxy reaches it at."""
        if not info.get("endpoint"):
            return None
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        replay = info.get("replay_endpoint")
        return cls(
            _reachable(info["endpoint"], host),
            _reachable(replay, host) if replay else None,
            str(info.get("topic") or ""),
            int(info["block_size"]),
            str(info["engine_id"]),
        )


def _reachable(endpoint: str, host: str) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if bound in _WILDCARDS:
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


class Subscription:
    """One worker's event stream, applied to its index in sequence order."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        source: EventsSource,
        label: str,
        curve: CurveClientKeys | None = None,
    ):
        self.ctx = ctx
        self.source = source
        self.label = label  # the worker's URL, for logs
        self.curve = curve
        self.index = BlockIndex(source.block_size)
        self.next_seq = 0
        self.num_gaps = 0  # batches lost for good (no replay, or past the replay buffer)
        self.is_ready = False  # caught up once: the index may be routed by
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.subscribe(self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            await self._catch_up()
            self.is_ready = True
            logger.info("KV events of %s: %d blocks after catching up", self.label, len(self.index))
            while True:
                if not await sub.poll(IDLE_CATCH_UP_S * 1000):
                    await self._catch_up()
                    continue
                frames = await sub.recv_multipart()
                if len(frames) == 3:
                    await self._receive(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 — routing goes on without this index; say why once
            logger.exception("KV events of %s: the subscription failed", self.label)
            self.is_ready = False
        finally:
            sub.close(linger=0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if ":" in self.source.endpoint.removeprefix("tcp://").rpartition(":")[0]:
            sock.ipv6 = True
        if self.curve is not None:
            self.curve.secure(sock)
        return sock

    async def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:  # a batch the replay already applied
            return
        if seq > self.next_seq:
            await self._catch_up()
        if seq > self.next_seq:
            self._skip_to(seq)
        if seq == self.next_seq:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(decode_batch(payload))
        except msgspec.DecodeError as e:
            logger.warning("KV events of %s: batch %d unreadable (%s)", self.label, seq, e)
        self.next_seq = seq + 1

    def _skip_to(self, seq: int) -> None:
        self.num_gaps += seq - self.next_seq
        logger.warning(
            "KV events of %s: batches %d..%d lost; the index may be stale",
            self.label, self.next_seq, seq - 1,
        )  # fmt: skip
        self.next_seq = seq

    async def _catch_up(self) -> None:
        """Apply what the replay endpoint has from `next_seq` on (vLLM's replay protocol)."""
        if self.source.replay_endpoint is None:
            return
        with self._socket(zmq.DEALER) as sock:
            sock.connect(self.source.replay_endpoint)
            await sock.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while await sock.poll(REPLAY_TIMEOUT_MS):
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                    return
                seq = int.from_bytes(frames[2], "big")
                if seq > self.next_seq:
                    self._skip_to(seq)
                if seq == self.next_seq:
                    self._apply(seq, frames[3])
            logger.warning("KV events of %s: no answer from the replay endpoint", self.label)


class KVEventFeeds:
    """The subscriptions of every worker in the pools, kept in step with them."""

    def __init__(
        self,
        workers: Callable[[], list[Worker]],
        headers: dict[str, str],
        connect_timeout: float,
        curve: CurveClientKeys | None = None,
    ):
        """`curve`: the subscriptions' CURVE keys; by default those in the environment."""
        self.workers = workers
        self.curve = curve or CurveClientKeys.from_env()
        self.headers = headers  # the cluster token, for the internal route
        self.timeout = httpx.Timeout(5.0, connect=connect_timeout)
        self.subscriptions: dict[Worker, Subscription] = {}
        self._asked: dict[Worker, float] = {}  # the worker's changed_at when last asked
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    def index_of(self, worker: Worker) -> BlockIndex | None:
        """The worker's index once its subscription has caught up; None: no events known."""
        sub = self.subscriptions.get(worker)
        return sub.index if sub is not None and sub.is_ready else None

    def sizes(self) -> list[tuple[Worker, int]]:
        """Blocks per worker with an index (for `pdserve_proxy_kv_index_blocks`)."""
        return [(w, len(s.index)) for w, s in self.subscriptions.items() if s.is_ready]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for worker in list(self.subscriptions):
            await self._drop(worker)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(SYNC_INTERVAL_S)

    async def sync(self) -> None:
        """Subscribe to workers that became healthy, drop those that left the pools."""
        workers = self.workers()
        for gone in set(self.subscriptions).difference(workers):
            await self._drop(gone)
        for gone in set(self._asked).difference(workers):
            del self._asked[gone]
        due = [w for w in workers if w.is_healthy and self._asked.get(w) != w.changed_at]
        await asyncio.gather(*(self._ask(w) for w in due))

    async def _ask(self, worker: Worker) -> None:
        changed_at = worker.changed_at
        try:
            r = await worker.client.get(EVENTS_PATH, headers=self.headers, timeout=self.timeout)
            info = r.json() if r.status_code == 200 else None
            source = EventsSource.parse(info, worker.url) if isinstance(info, dict) else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.info("KV events of %s: not asked (%r); asking again", worker.url, e)
            return  # not recorded: the next sync asks again
        if r.status_code not in (200, 404):  # 404: a worker without the route (vLLM's)
            logger.warning(
                "KV events of %s: %s answered %d", worker.url, EVENTS_PATH, r.status_code
            )
        self._asked[worker] = changed_at
        sub = self.subscriptions.get(worker)
        if sub is not None and sub.source == source and sub.is_running:
            return
        if sub is not None:
            logger.warning("KV events of %s: a new engine or endpoint; index reset", worker.url)
            await self._drop(worker)
        if source is not None:
            self._subscribe(worker, source)

    def _subscribe(self, worker: Worker, source: EventsSource) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self.subscriptions[worker] = Subscription(self._ctx, source, worker.url, self.curve)
        sub.start()
        logger.info("KV events of %s: subscribed to %s", worker.url, source.endpoint)

    async def _drop(self, worker: Worker) -> None:
        sub = self.subscriptions.pop(worker, None)
        if sub is not None:
            await sub.close()
