"""Publish KV event batches over ZMQ the way vLLM's `ZmqEventPublisher` does.

    PUB (`endpoint`):  multipart [topic, seq, payload] per batch; seq is an 8-byte big-endian
                       count from 0, payload a msgpack `KVEventBatch` (common/kv_cache/events.py)
    ROUTER (`replay_endpoint`, optional):  a request [start_seq] (8 bytes big-endian, after
                       REQ/DEALER's empty delimiter) is answered with every buffered batch from
                       start_seq on, each [topic, seq, payload], then the end marker
                       [b"", seq -1 (8 bytes, signed), b""]

A wildcard host (`tcp://*:5557`, `tcp://[::]:5557`) or an ipc/inproc endpoint is bound, any
other endpoint is connected to (vLLM's rule); the replay endpoint is always bound. A wildcard is
bound on the worker's `--host` (`bind_host`), not on every interface: `tcp://*:5557` keeps
vLLM's spelling and listens where the worker's HTTP port does.

Hardening: each subscriber's send queue holds at most `hwm` batches (past it that subscriber
misses batches and catches up by replay); replay requests are served a few batches at a time
under a budget per peer host (event_replay.py), between sends of new batches; with `curve` both
sockets speak CURVE (encrypted) and admit only the listed subscribers' public keys, checked by
a ZAP handler thread of the publisher's own ZMQ context. Without CURVE, every TCP address it
binds is named in a warning at start (`open_addresses`; the worker's `--kv-events-require-curve`
makes it an error).

`publish` runs on the engine thread and never blocks: it numbers the batch and queues it for
the publisher's own thread, which encodes, sends and buffers it for replay. When the queue is
full the batch is dropped and counted (`num_dropped`); its number is skipped, so subscribers
see the gap. Only the publisher's thread touches its sockets; `close` stops it and joins it.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from collections import deque

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from common.config import CurveServerKeys, KVEventsConfig
from common.kv_cache.event_replay import ReplayMessage, ReplayQueue
from common.kv_cache.events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_IDLE_S = 0.1  # how long the thread waits for a batch before it serves replay requests again
_REPLAY_CHUNK = 32  # replay messages sent between two looks at the queue of new batches
_REQUESTS_PER_LOOK = 64  # replay requests read between two looks at the queue
_WILDCARDS = ("*", "[*]", "::", "[::]", "0.0.0.0")
_ZAP_DOMAIN = "pdserve-kv-events"


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
        self._replays = ReplayQueue(cfg.replay_rate, cfg.buffer_steps)
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        self._auth = _start_auth(self._ctx, cfg.curve) if cfg.curve else None
        try:
            self._pub = _open_pub(self._ctx, cfg)
            self._replay = _open_replay(self._ctx, cfg)
        except (zmq.ZMQError, OSError) as e:
            self._stop_sockets()
            raise ValueError(f"cannot open the KV events endpoint: {e}") from e
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if unauthenticated := open_addresses(cfg):
            logger.warning(
                "KV EVENTS ARE NOT AUTHENTICATED: %s bound without CURVE keys, so anyone who "
                "reaches it reads every cached prompt's token ids. Set the keys "
                "(docs/security.md, 'KV events: CURVE and budgets'), or pass "
                "--kv-events-require-curve to refuse to start without them",
                " and ".join(unauthenticated),
            )
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
                self._publish_queued(encoder)
                self._receive_replay_requests()
                if self._replays.is_due:
                    self._send_replays(self._replays.take(_REPLAY_CHUNK))
                    continue
                try:
                    self._publish(encoder, *self._queue.get(timeout=_IDLE_S))
                except queue.Empty:
                    continue
        except Exception:  # noqa: BLE001 — serving goes on without events; say why once
            logger.exception("the KV events thread failed; no more KV events are published")
        finally:
            self._stop_sockets()

    def _stop_sockets(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    def _publish(self, encoder: msgspec.msgpack.Encoder, seq: int, batch: KVEventBatch) -> None:
        payload = encoder.encode(batch)
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self._buffer.append((seq, payload))

    def _publish_queued(self, encoder: msgspec.msgpack.Encoder) -> None:
        while True:
            try:
                self._publish(encoder, *self._queue.get_nowait())
            except queue.Empty:
                return

    def _receive_replay_requests(self) -> None:
        for _ in range(_REQUESTS_PER_LOOK):
            if self._replay is None or not self._replay.poll(0):
                return
            frames = self._replay.recv_multipart(copy=False)
            if len(frames) != 3 or len(frames[2].bytes) != 8:
                logger.warning(
                    "ignoring a malformed KV events replay request (%d frames)", len(frames)
                )
                continue
            start_seq = int.from_bytes(frames[2].bytes, "big")
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            peer = _peer_of(frames[0])
            if not self._replays.add(peer, frames[0].bytes, batches):
                logger.warning("KV events: a replay request of %s refused (too many)", peer)

    def _send_replays(self, messages: list[ReplayMessage]) -> None:
        for m in messages:
            if m.seq is None:
                self._replay.send_multipart((m.client, b"", b"", END_OF_REPLAY, b""))
            else:
                self._replay.send_multipart(
                    (m.client, b"", self._topic, seq_bytes(m.seq), m.payload)
                )


def _peer_of(frame: zmq.Frame) -> str:
    """The requester's host (ZMQ's `Peer-Address`), or its identity where there is none."""
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:  # ipc, inproc
        return frame.bytes.hex()


def bind_address(endpoint: str, host: str | None) -> str:
    """`endpoint` with a wildcard host replaced by `host` (the worker's --host; a name is
    resolved: ZMQ binds addresses and interfaces). Other endpoints are returned as they are."""
    if host is None or not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if bound not in _WILDCARDS:
        return endpoint
    address = _address_of(host)
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def open_addresses(cfg: KVEventsConfig) -> list[str]:
    """The TCP addresses the publisher binds without CURVE (none with keys): whoever reaches one
    may subscribe and read the prompts' token ids. A connected PUB endpoint is not listed."""
    if cfg.curve is not None or cfg.endpoint is None:
        return []
    bound = [cfg.endpoint] if _is_bind_endpoint(cfg.endpoint) else []
    bound += [cfg.replay_endpoint] if cfg.replay_endpoint is not None else []
    return [bind_address(e, cfg.bind_host) for e in bound if e.startswith("tcp://")]


def _address_of(host: str) -> str:
    host = host.strip("[]") or "0.0.0.0"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def _start_auth(ctx: zmq.Context, keys: CurveServerKeys) -> ThreadAuthenticator:
    auth = ThreadAuthenticator(ctx, log=logger)
    auth.start()
    auth.configure_curve_callback(_ZAP_DOMAIN, _AllowedKeys(keys.client_public_keys))
    return auth


class _AllowedKeys:
    """The ZAP handler's test of a subscriber's CURVE public key."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = frozenset(k.encode() for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def _secure(sock: zmq.Socket, cfg: KVEventsConfig, address: str) -> None:
    if ":" in address.removeprefix("tcp://").rpartition(":")[0]:
        sock.ipv6 = True
    if cfg.curve is not None:
        sock.curve_server = True
        sock.curve_secretkey = cfg.curve.secret_key.encode()
        sock.zap_domain = _ZAP_DOMAIN.encode()


def _open_pub(ctx: zmq.Context, cfg: KVEventsConfig) -> zmq.Socket:
    sock = ctx.socket(zmq.PUB)
    sock.set_hwm(cfg.hwm)
    address = bind_address(cfg.endpoint, cfg.bind_host)
    _secure(sock, cfg, address)
    if _is_bind_endpoint(cfg.endpoint):
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def _open_replay(ctx: zmq.Context, cfg: KVEventsConfig) -> zmq.Socket | None:
    if cfg.replay_endpoint is None:
        return None
    sock = ctx.socket(zmq.ROUTER)
    sock.set_hwm(cfg.hwm)
    address = bind_address(cfg.replay_endpoint, cfg.bind_host)
    _secure(sock, cfg, address)
    sock.bind(address)
    return sock


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
