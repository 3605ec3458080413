"""`Peers` in-process, against a real handshake endpoint on loopback and a connector that only
keeps its peers: concurrent first requests share one handshake, a restarted peer retires its
old incarnation, and what fails is raised as the HTTP layer expects (test_kv_peers.py and
test_pd_pull.py prove the same between real workers)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.kv_transfer.base import KVConnector
from common.kv_transfer.handshake import compat_hash, encode_metadata
from common.kv_transfer.peers import PeerIncompatible, Peers, PeerUnreachable

OURS = {"model": "m", "dtype": "torch.float32", "block_size": 16, "protocol_version": 3}


class PeerBook(KVConnector):
    """A connector that moves nothing and keeps the peers it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[str, dict] = {}
        self.retired: list[str] = []

    def start_load_kv(self, ctx) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name, kv_cache, attn_metadata) -> None: ...
    def wait_for_save(self) -> None: ...

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        self.peers[layout["engine_id"]] = layout

    def has_peer(self, engine_id: str) -> bool:
        return engine_id in self.peers

    def retire_peer(self, engine_id: str) -> None:
        self.peers.pop(engine_id)
        self.retired.append(engine_id)

    @property
    def num_peers(self) -> int:
        return len(self.peers)


def call_now(fn, *args) -> Future:
    """The engine's call, without an engine thread."""
    future: Future = Future()
    future.set_result(fn(*args))
    return future


class Remote:
    """A worker's `GET /internal/kv/handshake` on loopback: serves `engine_id` and `compat`,
    slowly enough that concurrent first requests overlap, and counts what it answered."""

    def __init__(self) -> None:
        self.engine_id, self.compat, self.num_served, self.headers = "p1", dict(OURS), 0, None
        remote = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(0.2)
                remote.num_served += 1
                remote.headers = dict(self.headers)
                body = json.dumps(remote.info()).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None: ...

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def info(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "protocol_version": 3,
            "compat_hash": compat_hash(self.compat),
            "compat": self.compat,
            "layout": {"engine_id": self.engine_id},
            "agent_metadata": encode_metadata(b"agent"),
        }


@pytest.fixture
def remote():
    remote = Remote()
    yield remote
    remote.server.shutdown()
    remote.server.server_close()


def peers_of(connector: PeerBook, counted: list) -> Peers:
    return Peers(
        connector,
        call_now,
        lambda: OURS,
        {"X-Internal-Token": "secret"},
        on_handshake=lambda: counted.append(1),
    )


def test_concurrent_first_requests_share_one_handshake(remote):
    connector, counted = PeerBook(), []
    peers = peers_of(connector, counted)

    async def first_requests() -> None:
        await asyncio.gather(*(peers.ensure("p1", "127.0.0.1", remote.port) for _ in range(8)))

    asyncio.run(first_requests())
    assert remote.num_served == 1 and len(counted) == 1
    assert connector.num_peers == 1 and remote.headers["X-Internal-Token"] == "secret"
    asyncio.run(peers.ensure("p1", "127.0.0.1", remote.port))  # known: no handshake
    assert remote.num_served == 1


def test_a_restarted_peer_retires_its_old_incarnation(remote):
    connector, counted = PeerBook(), []
    peers = peers_of(connector, counted)
    asyncio.run(peers.ensure("p1", "127.0.0.1", remote.port))
    remote.engine_id = "p2"
    asyncio.run(peers.ensure("p2", "127.0.0.1", remote.port))
    assert list(connector.peers) == ["p2"] and connector.retired == ["p1"]
    with pytest.raises(PeerUnreachable, match=r"engine p1 is gone \(.* now serves engine p2\)"):
        asyncio.run(peers.ensure("p1", "127.0.0.1", remote.port))  # a late request for the old
    assert list(connector.peers) == ["p2"]


def test_an_incompatible_peer_is_refused_with_what_differs(remote):
    connector = PeerBook()
    remote.compat = {**OURS, "block_size": 32}
    with pytest.raises(PeerIncompatible, match="block_size: 32 there, 16 here"):
        asyncio.run(peers_of(connector, []).ensure("p1", "127.0.0.1", remote.port))
    assert connector.num_peers == 0


def test_a_peer_that_does_not_answer_is_unreachable(remote):
    port = remote.port
    remote.server.shutdown()
    remote.server.server_close()
    with pytest.raises(PeerUnreachable, match="handshake with .* failed"):
        asyncio.run(peers_of(PeerBook(), []).ensure("p1", "127.0.0.1", port))
