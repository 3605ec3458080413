"""The workers this one moves KV with, met on the event loop: `Peers.ensure(engine_id, host,
port)` before a request that reads from (pull, D) or writes to (push, P) another worker.

The first request naming a peer fetches its `HandshakeInfo` (`GET /internal/kv/handshake`, the
cluster token attached), checks that its KV is ours (`compat_hash`), and adds it to the
connector. Concurrent first requests to one host:port share that one handshake. One peer is
kept per host:port, not one per incarnation: when a new engine id answers there (the worker
restarted), the old one is retired.

What fails is raised for the HTTP layer to answer: `PeerIncompatible` (the peer's KV differs:
the request is refused, the message names what differs) and `PeerUnreachable` (no handshake,
or the engine named is gone: the failure policy decides).

Threads: `ensure` runs on the event loop and never blocks the engine thread with the network
wait; adding and retiring a peer in the connector run on the engine thread, through `call`
(`AsyncEngine.call`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

import httpx

from common.kv_transfer.base import KVConnector
from common.kv_transfer.handshake import HandshakeInfo, compat_hash, explain_mismatch

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0


class PeerUnreachable(Exception):
    """No handshake with the peer, or the engine named is no longer there."""


class PeerIncompatible(Exception):
    """The peer's KV is not this worker's (model, dtype, layout or protocol differ)."""


class Peers:
    """One handshake in flight per host:port and the engine id last met there."""

    def __init__(
        self,
        connector: KVConnector,
        call: Callable[..., Future],
        local_compat: Callable[[], dict],
        headers: dict[str, str],
        on_handshake: Callable[[], None] = lambda: None,
    ) -> None:
        """`call(fn, *args)`: runs `fn` on the engine thread; `local_compat()`: this worker's
        compat fields (handshake.local_compat); `headers`: sent with every handshake (the
        cluster token); `on_handshake`: counts each new peer (metrics)."""
        self.connector = connector
        self.call = call
        self.local_compat = local_compat
        self.headers = headers
        self.on_handshake = on_handshake
        self.pending: dict[tuple[str, int], asyncio.Future] = {}
        self.engine_at: dict[tuple[str, int], str] = {}

    async def ensure(self, engine_id: str, host: str, port: int) -> bool:
        """The peer `engine_id` at host:port is known once this returns (a handshake unless it
        was already); True when this call waited for a handshake."""
        key = (host, port)
        waited = False
        while not self.connector.has_peer(engine_id):
            waited = True
            pending = self.pending.get(key)
            if pending is None:
                pending = asyncio.ensure_future(self._handshake(engine_id, host, port))
                self.pending[key] = pending
                pending.add_done_callback(lambda done: self.pending.pop(key, None))
            await asyncio.shield(pending)
            if self.engine_at.get(key) != engine_id:
                raise PeerUnreachable(f"engine {engine_id} is gone ({host}:{port} serves another)")
        return waited

    async def _handshake(self, engine_id: str, host: str, port: int) -> None:
        url = f"http://{host}:{port}/internal/kv/handshake"
        info = await self._fetch(url)
        if info.engine_id != engine_id:
            raise PeerUnreachable(
                f"engine {engine_id} is gone ({url} now serves engine {info.engine_id})"
            )
        # the first call reads the model folder: off the event loop, as docs/reliability.md says
        ours = await asyncio.to_thread(self.local_compat)
        if info.compat_hash != compat_hash(ours):
            raise PeerIncompatible(
                f"engine {info.engine_id} is incompatible with this worker: "
                f"{explain_mismatch(ours, info.compat)}"
            )
        await asyncio.wrap_future(
            self.call(self.connector.add_peer, info.layout, info.metadata_bytes())
        )
        self.on_handshake()
        logger.info("handshake with engine %s at %s", info.engine_id, url)
        old = self.engine_at.get((host, port))
        self.engine_at[(host, port)] = engine_id
        if old not in (None, engine_id):
            await asyncio.wrap_future(self.call(self.connector.retire_peer, old))

    async def _fetch(self, url: str) -> HandshakeInfo:
        try:
            async with httpx.AsyncClient(timeout=HANDSHAKE_TIMEOUT_S) as client:
                r = await client.get(url, headers=self.headers)
                r.raise_for_status()
            return HandshakeInfo.model_validate(r.json())
        except (httpx.HTTPError, ValueError) as e:
            raise PeerUnreachable(f"handshake with {url} failed: {e!r}") from e
