"""KV events in vLLM's format: the bytes vLLM 0.32 sends, the pool's hooks, the ZMQ publisher
(sequence numbers, replay, drops), and a subscriber that rebuilds an engine's block set from the
events and finds it equal to the engine's prefix cache, through evictions and a reset.

Events are read as a router built for vLLM reads them (tests/kv_event_consumer.py).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import httpx
import msgspec
import pytest
import torch
import zmq

from common.api.cli import parse_args
from common.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig
from common.engine.async_engine import AsyncEngine
from common.engine.engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.kv_cache.block_pool import BlockPool
from common.kv_cache.event_publisher import KVEventPublisher
from common.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    KVEventCollector,
    external_hash,
    salt_extra_keys,
)
from common.kv_cache.manager import KVCacheManager
from proxy.kv_index import BlockIndex, decode_batch, root_of
from tests.kv_event_consumer import (
    DECODE,
    CacheMirror,
    VllmAllBlocksCleared,
    VllmBlockStored,
    replay,
)
from tests.servers import free_port, wait_until
from tests.test_block_pool import Seq
from tests.tiny_models import VOCAB

# What vLLM 0.32 encodes (its ZmqEventPublisher sets data_parallel_rank 0) for
# KVEventBatch(1.5, [BlockStored([1, 2**64 - 1], 7, [1, 2, 3, 4], 2, None, "GPU", None,
# extra_keys=[None, None], group_idx=0), BlockRemoved([1], "GPU", group_idx=0),
# AllBlocksCleared()], 0): captured from vLLM itself.
VLLM_BYTES = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920"
    "1cfffffffffffffffffb1706172656e745f626c6f636b5f6861736807a9746f6b656e5f6964739401020304"
    "aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa"
    "65787472615f6b65797392c0c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac"
    "626c6f636b5f6861736865739101a66d656469756da3475055a967726f75705f6964780081a474797065b041"
    "6c6c426c6f636b73436c656172656400"
)


def key(last_8_bytes: int) -> bytes:
    """A 32-byte block key that goes out as `last_8_bytes` (`external_hash`)."""
    return bytes(range(24)) + last_8_bytes.to_bytes(8, "big")


def test_batches_encode_as_vllm_does_and_decode_into_its_shapes():
    events = KVEventCollector(block_size=2)
    events.stored(key(1), key(7), [1, 2])
    events.stored(key(2**64 - 1), key(1), [3, 4])  # continues the chain: one event
    events.removed(key(1))
    ours = msgspec.msgpack.encode(KVEventBatch(1.5, [*events.take(), AllBlocksCleared()], 0))
    assert ours == VLLM_BYTES

    batch = DECODE(ours)
    assert msgspec.msgpack.encode(batch) == ours  # nothing lost, nothing added
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [1, 2**64 - 1] and stored.parent_block_hash == 7
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2
    assert stored.medium == "GPU" and stored.extra_keys == [None, None] and stored.group_idx == 0
    assert removed.block_hashes == [1] and isinstance(cleared, VllmAllBlocksCleared)


# -- the pool's hooks ---------------------------------------------------------------------------
def test_pool_records_stored_evicted_and_cleared_blocks():
    pool = BlockPool(4)
    pool.events = KVEventCollector(block_size=4)
    kv = KVCacheManager(pool, block_size=4)
    seq = Seq(range(10))  # two full blocks and a partial one
    assert kv.allocate_slots(seq, 10)
    kv.cache_full_blocks(seq, 10)
    kv.cache_full_blocks(seq, 10)  # already cached: nothing new
    (stored,) = pool.take_events()
    h0, h1 = seq.block_hashes
    assert stored.block_hashes == [external_hash(h0), external_hash(h1)]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    kv.free(seq)
    other = Seq(range(100, 116))
    assert kv.allocate_slots(other, 16)  # all four blocks: both cached ones are evicted
    (removed,) = pool.take_events()
    assert sorted(removed.block_hashes) == sorted(external_hash(h) for h in (h0, h1))
    other.num_computed_tokens = 16
    kv.cache_full_blocks(other, 16)
    kv.free(other)
    pool.reset_prefix_cache()
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]
    assert pool.take_events() == [] and pool.cached_hashes() == set()


# -- the publisher ------------------------------------------------------------------------------
def test_publisher_numbers_batches_replays_them_and_drops_when_full():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"kv")
    sub_port, replay_port = free_port(), free_port()
    sub.bind(f"tcp://127.0.0.1:{sub_port}")  # a host, not a wildcard: the publisher connects
    cfg = KVEventsConfig(
        f"tcp://127.0.0.1:{sub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv"
    )
    pub = KVEventPublisher(cfg)
    try:
        pub.publish([])  # an empty step sends nothing
        for i in range(5):
            pub.publish([BlockRemoved([i], "GPU", 0)])
        live = []
        while sub.poll(200):  # the first ones may go out before the connection is up
            live.append(sub.recv_multipart())
        for i in range(5, 8):
            pub.publish([BlockRemoved([i], "GPU", 0)])
        while len(live) < 3 or int.from_bytes(live[-1][1], "big") < 7:
            assert sub.poll(5000), "no batch arrived"
            live.append(sub.recv_multipart())
        seqs = [int.from_bytes(seq, "big") for _, seq, _ in live]
        assert {topic for topic, _, _ in live} == {b"kv"}
        assert seqs == list(range(seqs[0], 8)), "one sequence number per batch, in order"
        replayed = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 3)
        assert [seq for seq, _ in replayed] == list(range(3, 8))
        assert [DECODE(p).events[0].block_hashes for _, p in replayed] == [[i] for i in range(3, 8)]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
    assert not pub.is_running
    full = KVEventPublisher(KVEventsConfig(f"tcp://127.0.0.1:{sub_port}", max_queue_size=1))
    full.close()  # nothing drains the queue now
    full.publish([AllBlocksCleared()])
    full.publish([AllBlocksCleared()])  # no room: dropped, never blocks
    assert full.num_dropped == 1


def test_cli_flags_reach_the_engine_config():
    engine, _ = parse_args(
        "decode",
        ["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558"]
        + ["--kv-events-topic", "w1", "--kv-events-queue-size", "64"],
    )
    expected = KVEventsConfig("tcp://*:5557", "tcp://*:5558", "w1", 64, bind_host="127.0.0.1")
    assert engine.kv_events == expected
    assert not parse_args("prefill", [])[0].kv_events.is_enabled
    with pytest.raises(ValueError, match="replay endpoint needs"):
        KVEventsConfig(replay_endpoint="tcp://*:5558")


# -- a router's view of a running engine ---------------------------------------------------------
class EngineThread:
    """An AsyncEngine publishing KV events, driven from an event loop on its own thread."""

    def __init__(self, cfg: EngineConfig):
        self.num_requests = 0
        self.is_stopped = False
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine = AsyncEngine(lambda: LLMEngine(cfg))
        self.run(self.engine.start())

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn):
        result: Future = self.engine.call(fn)
        return result.result(10)

    def cached_hashes(self) -> set[int]:
        return {external_hash(h) for h in self.call(self.engine.engine.pool.cached_hashes)}

    @property
    def root(self) -> bytes:
        """The parent of a first block without a salt: what the events' hashes chain from."""
        return self.engine.engine.scheduler.kv.root(None)

    def generate(self, prompts: list[list[int]]) -> None:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

        async def one(prompt):
            self.num_requests += 1
            return [o async for o in self.engine.generate(str(self.num_requests), prompt, params)]

        async def all_of():
            await asyncio.gather(*(one(p) for p in prompts))

        self.run(all_of())

    def stop(self) -> None:
        if not self.is_stopped:
            self.is_stopped = True
            self.run(self.engine.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def ports():
    return free_port(), free_port()


@pytest.fixture(scope="module")
def worker(tiny_model, ports):
    pub_port, replay_port = ports
    cfg = EngineConfig(
        model=ModelConfig(
            str(tiny_model("llama")), dtype="float32", max_model_len=64, enforce_eager=True
        ),
        cache=CacheConfig(block_size=4, num_blocks=24),  # room for ~4 requests' blocks
        kv_events=KVEventsConfig(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}"),
    )
    worker = EngineThread(cfg)
    yield worker
    worker.stop()


def urls(ports) -> tuple[str, str]:
    return f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"


@pytest.fixture
def mirror(ports, worker):
    ctx = zmq.Context()
    mirror = CacheMirror(ctx, *urls(ports), worker.root)
    yield mirror
    ctx.destroy(linger=0)


def random_prompts(seed: int, num: int, length: int, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [prefix + torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(num)]


def converges(mirror: CacheMirror, worker: EngineThread) -> bool:
    return wait_until(lambda: mirror.poll() or mirror.blocks == worker.cached_hashes(), 20, 0)


def test_subscriber_rebuilds_the_prefix_cache_through_evictions(worker, mirror):
    (shared,) = random_prompts(1, 1, 12)
    worker.generate(random_prompts(2, 3, 5, prefix=shared))  # three blocks shared
    assert converges(mirror, worker)
    # ZMQ's slow joiner: batches published before the subscription reached the worker arrive by
    # replay (a busy machine can take that long); one more prompt a try until one comes live
    for seed in range(100, 110):
        if mirror.num_live > 0:
            break
        worker.generate(random_prompts(seed, 1, 5))
        assert converges(mirror, worker)
    assert mirror.blocks and mirror.num_live > 0, "the live stream carried batches"
    for seed in range(3, 7):  # ~24 blocks of distinct prompts a round: cached blocks evicted
        worker.generate(random_prompts(seed, 3, 17))
    assert converges(mirror, worker)
    assert {"VllmBlockStored", "VllmBlockRemoved"} <= mirror.kinds


def test_a_prefix_cache_reset_clears_every_block(worker, mirror):
    worker.generate(random_prompts(10, 2, 9))
    assert converges(mirror, worker) and mirror.blocks
    worker.call(worker.engine.engine.pool.reset_prefix_cache)
    assert converges(mirror, worker) and mirror.blocks == set()
    assert "VllmAllBlocksCleared" in mirror.kinds


def test_a_late_subscriber_replays_from_zero(worker, ports):
    worker.generate(random_prompts(20, 2, 13))
    ctx = zmq.Context()
    try:
        late = CacheMirror(ctx, *urls(ports), worker.root)
        batches = replay(ctx, f"tcp://127.0.0.1:{ports[1]}", 0)
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
        for seq, payload in batches:
            late.apply(seq, payload)
        assert converges(late, worker) and late.blocks
    finally:
        ctx.destroy(linger=0)


def test_stopping_the_engine_closes_the_publisher(worker, ports):
    worker.stop()
    assert not worker.engine.kv_events.is_running
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.PUB) as sock:  # the port is free again: the socket was closed
            sock.bind(f"tcp://*:{ports[0]}")
    finally:
        ctx.term()


def test_a_worker_process_publishes_and_stops_cleanly(start_server, tiny_model):
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        args = "--kv-connector none --num-blocks 32 --block-size 4 --max-model-len 64 "
        args += f"--model {tiny_model('llama')} --kv-events-endpoint tcp://*:{port}"
        server = start_server("prefill", *args.split())
        prompts, sent, stored = iter(random_prompts(30, 20, 10)), [], []

        def prompt_blocks_arrive() -> bool:  # a new prompt each try: ZMQ's slow joiner
            sent.append(next(prompts)[:8])
            body = {"prompt": sent[-1] + [7, 7], "max_tokens": 1}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).raise_for_status()
            while sub.poll(200):
                events = DECODE(sub.recv_multipart()[2]).events
                stored.extend(e.token_ids for e in events if isinstance(e, VllmBlockStored))
            return any(tokens in sent for tokens in stored)

        assert wait_until(prompt_blocks_arrive, 30, 0), stored
        assert server.stop() == 0, server.log()
    finally:
        sub.close(linger=0)
        ctx.term()


# -- cache_salt in events --------------------------------------------------------------------------
def test_a_salted_chain_names_its_salt_by_tag_and_routers_root_it_apart():
    """The first block of a salted chain carries the salt's tag in `extra_keys` (never the salt),
    and the proxy's index (proxy/kv_index.py) files it under that root: a prompt without the
    salt matches none of it, one with the salt all of it."""
    pool = BlockPool(8)
    pool.events = KVEventCollector(block_size=4)
    kv = KVCacheManager(pool, block_size=4, namespace="model")
    for salt in ("tenant-1", None):
        seq = Seq(range(9), cache_salt=salt)
        assert kv.allocate_slots(seq, 9)
        kv.cache_full_blocks(seq, 9)
        kv.free(seq)
    payload = msgspec.msgpack.encode(KVEventBatch(0.0, pool.take_events(), 0))
    assert b"tenant-1" not in payload
    salted, plain = DECODE(payload).events
    assert salted.extra_keys == [salt_extra_keys("tenant-1"), None]
    assert salted.parent_block_hash is None and plain.extra_keys == [None, None]
    index = BlockIndex(block_size=4)
    index.store(decode_batch(payload).events[0])  # the salted chain alone
    assert index.match(list(range(9))) == 0
    assert index.match(list(range(9)), root_of(salt_extra_keys("tenant-1"))) == 2
    assert index.match(list(range(9)), root_of(salt_extra_keys("tenant-2"))) == 0
