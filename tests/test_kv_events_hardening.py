"""The KV events sockets, hardened: a wildcard endpoint binds the worker's --host only, the
send high-water mark is bounded, replay requests are served under a budget per peer host
without holding back publishing, and with CURVE keys only the listed subscribers are served.
"""

from __future__ import annotations

import os

import zmq

from common.api.cli import kv_events_curve, parse_args
from common.config import CurveServerKeys, KVEventsConfig
from common.kv_cache import curve_keys
from common.kv_cache.event_publisher import END_OF_REPLAY, KVEventPublisher, bind_address
from common.kv_cache.event_replay import MAX_JOBS_PER_PEER, ReplayQueue
from common.kv_cache.events import BlockRemoved
from tests.servers import free_port, wait_until
from tests.test_listeners import listeners


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def publish(pub: KVEventPublisher, n: int) -> None:
    for i in range(n):
        pub.publish([BlockRemoved([i], "GPU", 0)])


def test_a_wildcard_endpoint_binds_the_worker_host_only():
    events, replay = free_port(), free_port()
    cfg = KVEventsConfig(f"tcp://*:{events}", f"tcp://[::]:{replay}", bind_host="127.0.0.1")
    pub = KVEventPublisher(cfg)
    try:
        bound = {(a, p) for a, p, _ in listeners(os.getpid()) if p in (events, replay)}
        assert bound == {("127.0.0.1", events), ("127.0.0.1", replay)}
    finally:
        pub.close()
    assert bind_address("tcp://*:1", "::1") == "tcp://[::1]:1"
    assert bind_address("tcp://*:1", "localhost") == "tcp://127.0.0.1:1"
    assert bind_address("tcp://*:1", "0.0.0.0") == "tcp://0.0.0.0:1"  # --host 0.0.0.0: as asked
    assert bind_address("tcp://10.0.0.1:1", "127.0.0.1") == "tcp://10.0.0.1:1"


def test_the_cli_binds_host_and_bounds_the_high_water_mark():
    engine, _ = parse_args("decode", ["--host", "127.0.0.2", "--kv-events-endpoint", "tcp://*:5"])
    assert engine.kv_events.bind_host == "127.0.0.2"
    assert engine.kv_events.hwm <= 1000  # was 100,000 batches per subscriber
    engine, _ = parse_args("decode", ["--kv-events-endpoint", "tcp://*:5", "--kv-events-hwm", "7"])
    assert engine.kv_events.hwm == 7


def test_the_replay_budget_is_per_peer_and_refills():
    clock = Clock()
    q = ReplayQueue(rate=1.0, burst=3, clock=clock)
    batches = [(i, b"x") for i in range(5)]
    assert q.add("flood", b"a", batches) and q.add("other", b"b", batches[:1])
    sent = q.take(100)
    # the peers take turns; the flooder stops at its burst, the other peer is served in full
    assert [(m.client, m.seq) for m in sent] == [
        (b"a", 0), (b"b", 0), (b"a", 1), (b"b", None), (b"a", 2)
    ]  # fmt: skip
    assert not q.is_due and q.take(100) == []
    clock.now = 2.0  # two more tokens
    assert [m.seq for m in q.take(100)] == [3, 4, None]
    for _ in range(MAX_JOBS_PER_PEER):
        assert q.add("flood", b"a", [])
    assert not q.add("flood", b"a", []) and q.num_refused == 1


def test_a_replay_flood_does_not_hold_back_publishing():
    ctx = zmq.Context()
    events, replay = free_port(), free_port()
    cfg = KVEventsConfig(
        f"tcp://*:{events}", f"tcp://*:{replay}", bind_host="127.0.0.1", buffer_steps=50,
        replay_rate=1e-9,
    )  # fmt: skip
    pub = KVEventPublisher(cfg)
    flooder = ctx.socket(zmq.DEALER)
    flooder.connect(f"tcp://127.0.0.1:{replay}")
    other = ctx.socket(zmq.DEALER)
    other.connect(f"tcp://127.0.0.2:0;127.0.0.1:{replay}")  # another peer host
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{events}")
    try:
        publish(pub, 50)
        assert wait_until(lambda: len(pub._buffer) == 50)
        for _ in range(6):
            flooder.send_multipart((b"", (0).to_bytes(8, "big")))
        publish(pub, 1)  # a live batch, after the flood (the SUB may miss earlier ones)
        seqs = []
        while 50 not in seqs and sub.poll(10_000):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert 50 in seqs
        other.send_multipart((b"", (40).to_bytes(8, "big")))
        got = []
        while other.poll(10_000) and (frames := other.recv_multipart())[2] != END_OF_REPLAY:
            got.append(int.from_bytes(frames[2], "big"))
        assert got == list(range(40, 51))  # the other host is served in full
        flood = 0
        while flooder.poll(500):
            flood += flooder.recv_multipart()[2] != END_OF_REPLAY
        assert flood == 50, "the flooder got more than its budget"  # 6 × 50 before
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_with_curve_only_listed_subscribers_are_served(monkeypatch, tmp_path):
    curve_keys.write_key_pairs(tmp_path)
    server_secret = (tmp_path / "server.key").read_text().strip()
    client_pub = (tmp_path / "client.pub").read_text().strip()
    monkeypatch.setenv(curve_keys.SERVER_SECRET_KEY + "_FILE", str(tmp_path / "server.key"))
    monkeypatch.setenv(curve_keys.CLIENT_KEYS, client_pub)
    assert kv_events_curve() == CurveServerKeys(server_secret, (client_pub,))
    monkeypatch.setenv(curve_keys.SERVER_KEY + "_FILE", str(tmp_path / "server.pub"))
    monkeypatch.setenv(curve_keys.CLIENT_SECRET_KEY + "_FILE", str(tmp_path / "client.key"))
    listed = curve_keys.CurveClientKeys.from_env()
    stranger = curve_keys.CurveClientKeys(listed.server_key, zmq.curve_keypair()[1].decode())

    events = free_port()
    cfg = KVEventsConfig(f"tcp://*:{events}", bind_host="127.0.0.1", curve=kv_events_curve())
    pub = KVEventPublisher(cfg)
    ctx = zmq.Context()
    try:
        subs = {}
        for name, keys in (("listed", listed), ("stranger", stranger), ("plain", None)):
            sock = subs[name] = ctx.socket(zmq.SUB)
            sock.subscribe(b"")
            if keys is not None:
                keys.secure(sock)
            sock.connect(f"tcp://127.0.0.1:{events}")
        monitor = subs["stranger"].get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        assert monitor.poll(10_000), "the stranger's key was not refused"
        assert wait_until(lambda: publish(pub, 1) or subs["listed"].poll(100), timeout=10)
        assert not subs["stranger"].poll(0) and not subs["plain"].poll(0)
    finally:
        pub.close()
        ctx.destroy(linger=0)
