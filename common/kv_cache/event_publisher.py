"""Publish KV event batches over ZMQ the way vLLM's `ZmqEventPublisher` does.

    PUB (`endpoint`):  multipart [topic, seq, payload] per batch; seq is an 8-byte big-endian
                       count from 0, payload a msgpack `KVEventBatch` (common/kv_cache/events.py)
    ROUTER (`replay_endpoint`, optional):  a request [start_seq] (8 bytes big-endian, after
                       REQ/DEALER's empty delimiter) is answered with every buffered batch from
                       start_seq on, each [topic, seq, payload], then the end marker
                       [b"", seq -1 (8 bytes, signed), b""]

A wildcard host (`tcp://*:5557`, `tcp://[::]:5557`) or an ipc/inproc endpoint is bound, any
other endpoint is connected to (vLLM's rule); the replay endpoint is always bound.

`publish` runs on the engine thread and never blocks: it numbers the batch and queues it for
the publisher's own thread, which encodes, sends and buffers it for replay. When the queue is
full the batch is dropped and counted (`num_dropped`); its number is skipped, so subscribers
see the gap. Only the publisher's thread touches its sockets; `close` stops it and joins it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from common.config import KVEventsConfig
from common.kv_cache.events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_IDLE_S = 0.1  # how long the thread waits for a batch before it serves replay requests again


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0):
        assert cfg.endpoint is not None, "a KV event publisher needs an endpoint"
        self.cfg = cfg
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0  # batches the queue had no room for
        self._next_seq = 0
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._pub = _open_pub(self._ctx, cfg.endpoint, cfg.hwm)
            self._replay = _open_replay(self._ctx, cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"cannot open the KV events endpoint: {e}") from e
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "publishing KV events on %s%s",
            cfg.endpoint,
            f" (replay on {cfg.replay_endpoint})" if cfg.replay_endpoint else "",
        )

    # -- the engine thread --------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch; nothing to do for none."""
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events queue full: %d batches dropped so far (routers' view of this "
                    "worker's cache is stale)",
                    self.num_dropped,
                )

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets and join the thread."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV events thread did not stop within %.1f s", timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # -- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while not (self._closing.is_set() and self._queue.empty()):
                self._serve_replay()
                try:
                    seq, batch = self._queue.get(timeout=_IDLE_S)
                except queue.Empty:
                    continue
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
                self._buffer.append((seq, payload))
        except Exception:  # noqa: BLE001 — serving goes on without events; say why once
            logger.exception("the KV events thread failed; no more KV events are published")
        finally:
            self._ctx.destroy(linger=0)

    def _serve_replay(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "ignoring a malformed KV events replay request (%d frames)", len(frames)
                )
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


def _open_pub(ctx: zmq.Context, endpoint: str, hwm: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PUB)
    sock.set_hwm(hwm)
    if _is_bind_endpoint(endpoint):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def _open_replay(ctx: zmq.Context, endpoint: str | None) -> zmq.Socket | None:
    if endpoint is None:
        return None
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    return sock


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
