"""NixlTransport against real peer processes: real NIXL agents over UCX on loopback."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # before nixl is imported, here and in peers
from common.kv_transfer.nixl.transport import KVLayout, NixlTransport, TransferError  # noqa: E402
from tests.nixl_peer import NUM_LAYERS, PeerProcess, block_bytes, make_kv  # noqa: E402

PEER_SEED, LOCAL_SEED = 1, 2


@pytest.fixture(scope="module")
def peers():
    """Three peer processes, started together: "peer" stays healthy, the others are doomed."""
    started = {name: PeerProcess.start(name, seed=PEER_SEED) for name in ("peer", "dies", "hangs")}
    yield started
    for peer in started.values():
        peer.kill()


@pytest.fixture(scope="module")
def local(peers):
    """(our transport, its KV tensors), connected both ways to the healthy peer."""
    kv = make_kv(LOCAL_SEED)
    with NixlTransport("local", kv) as transport:
        connect(transport, peers["peer"])
        yield transport, kv


def connect(transport: NixlTransport, peer: PeerProcess) -> None:
    layout, metadata = peer.hello()
    transport.add_peer(KVLayout.from_dict(layout), metadata)
    peer.call("add_peer", transport.layout.to_dict(), transport.metadata())


def wait_for(fetch, count: int, timeout: float = 5.0) -> list[bytes]:
    """Accumulate fetch() results until `count` items arrived."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += fetch()
        time.sleep(0.01)
    return got


@pytest.mark.parametrize(
    "local_blocks, remote_blocks",
    [([0, 1, 2, 3], [4, 5, 6, 7]), ([12, 1, 8, 3, 0], [9, 2, 15, 5, 7])],
    ids=["contiguous", "shuffled"],
)
def test_read_lands_exactly(local, local_blocks, remote_blocks):
    transport, kv = local
    futures = [
        transport.read_layer("peer", layer, local_blocks, remote_blocks)
        for layer in range(NUM_LAYERS)
    ]
    results = [f.result(timeout=5) for f in futures]
    expected = make_kv(PEER_SEED)
    for layer in range(NUM_LAYERS):
        assert block_bytes(kv, layer, local_blocks) == block_bytes(expected, layer, remote_blocks)
    # one descriptor per K/V per run consecutive on both sides (NIXL posts no per-block work)
    assert results[0].num_descriptors == 2 * count_runs(local_blocks, remote_blocks)
    layout = transport.layout
    assert results[0].num_bytes == 2 * len(local_blocks) * layout.block_len(layout.shards[0])


def count_runs(local_blocks: list[int], remote_blocks: list[int]) -> int:
    pairs = list(zip(local_blocks, remote_blocks, strict=True))
    return sum(1 for i, (lb, rb) in enumerate(pairs) if i == 0 or pairs[i - 1] != (lb - 1, rb - 1))


def test_runs_are_one_descriptor_pair(local):
    """Two runs (blocks 4..9 -> 0..5, then 1..2 -> 8..9) move as 4 descriptors a layer, and
    every byte lands where the per-block mapping says."""
    local_blocks, remote_blocks = [4, 5, 6, 7, 8, 9, 1, 2], [0, 1, 2, 3, 4, 5, 8, 9]
    test_read_lands_exactly(local, local_blocks, remote_blocks)
    result = local[0].read_layer("peer", 1, local_blocks, remote_blocks).result(timeout=5)
    assert result.num_descriptors == 4 and result.post_s > 0


def test_a_layout_outside_the_peers_memory_is_refused_at_handshake(local, peers):
    transport, _ = local
    layout, metadata = peers["dies"].hello()
    (shard,) = layout["shards"]
    moved = {**shard, "base_addrs": [a + 2**40 for a in shard["base_addrs"]]}
    lying = {**layout, "engine_id": "liar", "shards": [moved]}
    with pytest.raises(Exception, match="(?i)not.?found"):
        transport.add_peer(KVLayout.from_dict(lying), metadata)
    assert not transport.has_peer("liar")
    test_read_lands_exactly(local, [0, 1], [2, 3])  # the real peer is still connected


def test_write_lands_and_notifies_per_layer(local, peers):
    transport, kv = local
    local_blocks, remote_blocks = [3, 4, 5], [10, 0, 14]
    futures = [
        transport.write_layer("peer", layer, local_blocks, remote_blocks, notif=b"w%d" % layer)
        for layer in range(NUM_LAYERS)
    ]
    for f in futures:
        f.result(timeout=5)
    notifs = wait_for(lambda: peers["peer"].call("notifs"), NUM_LAYERS)
    assert Counter(notifs) == Counter(b"w%d" % layer for layer in range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        landed = peers["peer"].call("blocks", layer, remote_blocks)
        assert landed == block_bytes(kv, layer, local_blocks)


def test_send_notif_both_ways(local, peers):
    transport, _ = local
    transport.send_notif("peer", b"ping")
    assert wait_for(lambda: peers["peer"].call("notifs"), 1) == [b"ping"]
    peers["peer"].call("send_notif", "local", b"pong")
    assert wait_for(transport.get_notifs, 1) == [b"pong"]


def test_bad_requests_raise_at_once(local):
    transport, _ = local
    with pytest.raises(ValueError, match="unknown peer"):
        transport.read_layer("nobody", 0, [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        transport.read_layer("peer", 0, [0], [16])
    with pytest.raises(ValueError, match="layer"):
        transport.read_layer("peer", NUM_LAYERS, [0], [0])
    with pytest.raises(ValueError, match="remote"):
        transport.read_layer("peer", 0, [0, 1], [0])


def test_idle_transport_does_not_burn_a_core(local):
    start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - start < 0.2


def test_layout_round_trips_through_json(local):
    layout = local[0].layout
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert layout.num_layers == NUM_LAYERS and layout.block_len(layout.shards[0]) == 16 * 2 * 16 * 2
    assert layout.mem_type == "DRAM"


def test_killed_peer_fails_the_next_read_fast(local, peers):
    transport, _ = local
    connect(transport, peers["dies"])
    transport.read_layer("dies", 0, [0], [0]).result(timeout=5)
    peers["dies"].kill()
    start = time.monotonic()
    with pytest.raises(TransferError, match="Disconnect"):
        transport.read_layer("dies", 0, [0], [0]).result(timeout=2)
    assert time.monotonic() - start < 2
    transport.remove_peer("dies")
    assert not transport.has_peer("dies")
    test_read_lands_exactly(local, [0, 1], [2, 3])  # the healthy peer is unaffected


def test_stopped_peer_times_out_at_the_deadline(local, peers):
    # NOTE: over an established cma connection, one-sided transfers to a stopped peer still
    # complete (process_vm_readv needs no help from it); connecting to one hangs.
    transport, _ = local
    peers["hangs"].hello()
    peers["hangs"].signal(signal.SIGSTOP)
    layout, metadata = peers["hangs"].hello()
    transport.add_peer(KVLayout.from_dict(layout), metadata)
    start = time.monotonic()
    future = transport.read_layer("hangs", 0, [0, 1], [0, 1], deadline=start + 0.5)
    with pytest.raises(TimeoutError):
        future.result(timeout=3)
    assert time.monotonic() - start < 1.0
    peers["hangs"].kill()  # SIGCONT, then SIGKILL
    transport.remove_peer("hangs")
    test_read_lands_exactly(local, [0, 1], [2, 3])


def test_the_progress_delay_comes_from_the_environment(monkeypatch):
    from common.kv_transfer.nixl.transport import progress_delay
    from common.settings import NIXL_PROGRESS_DELAY_ENV as PROGRESS_DELAY_ENV

    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    assert progress_delay() == 1000
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "10000")
    assert progress_delay() == 10000
    for bad in ("0", "1.5", "fast"):
        monkeypatch.setenv(PROGRESS_DELAY_ENV, bad)
        with pytest.raises(ValueError, match=PROGRESS_DELAY_ENV):
            progress_delay()
