"""A KV-aware router's side of vLLM's KV events, for the tests: vLLM 0.32's event shapes as a
consumer declares them (written from `vllm/distributed/kv_events.py`, independently of
common/kv_cache/events.py), its replay protocol, and `CacheMirror`, which rebuilds a worker's
block set from the events it is sent."""

from __future__ import annotations

import msgspec
import zmq

from common.kv_cache.events import external_hash
from common.kv_cache.manager import hash_block

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

Hash = int | bytes


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(VllmBatch).decode


def replay(ctx: zmq.Context, url: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol: send a start seq, read batches until the end marker."""
    with ctx.socket(zmq.DEALER) as sock:
        sock.connect(url)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(5000), "no answer from the replay socket"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_OF_REPLAY:
                return got
            got.append((int.from_bytes(seq, "big"), payload))


class CacheMirror:
    """Rebuilds a worker's block set from its events, in sequence order; what the live stream
    missed (a subscriber that joined late, ZMQ's slow joiner) it asks the replay socket for."""

    def __init__(self, ctx: zmq.Context, url: str, replay_url: str, root: bytes):
        """`root`: the worker's first-block parent for prompts without a salt (its
        `KVCacheManager.root(None)`): each hash sent is checked against the key it names."""
        self.ctx, self.replay_url, self.root = ctx, replay_url, root
        self.keys: dict[int, bytes | None] = {}  # the key each hash sent names (None: salted)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.subscribe(b"")
        self.sub.connect(url)
        self.blocks: set[int] = set()
        self.ever_stored: set[int] = set()
        self.next_seq = 0
        self.num_live = 0
        self.kinds: set[str] = set()

    def apply(self, seq: int, payload: bytes) -> None:
        if seq != self.next_seq:
            return
        self.next_seq += 1
        for event in DECODE(payload).events:
            self.kinds.add(type(event).__name__)
            if isinstance(event, VllmBlockStored):
                self._store(event)
            elif isinstance(event, VllmBlockRemoved):
                assert self.blocks >= set(event.block_hashes), "removed a block never stored"
                self.blocks.difference_update(event.block_hashes)
            else:
                self.blocks.clear()

    def _store(self, event: VllmBlockStored) -> None:
        size, parent = event.block_size, event.parent_block_hash
        assert parent is None or parent in self.ever_stored, "a parent nobody stored"
        assert len(event.token_ids) == size * len(event.block_hashes)
        is_salted = parent is None and (event.extra_keys or [None])[0] is not None
        key = None if is_salted else self.root if parent is None else self.keys[parent]
        for i, h in enumerate(event.block_hashes):  # each hash covers its parent and its tokens
            if key is not None:
                key = hash_block(key, event.token_ids[i * size : (i + 1) * size])
                assert h == external_hash(key), "hash, parent and tokens disagree"
            self.keys[h] = key
        self.blocks.update(event.block_hashes)
        self.ever_stored.update(event.block_hashes)

    def poll(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            _, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self.catch_up()
            self.num_live += seq == self.next_seq
            self.apply(seq, payload)
            timeout_ms = 0
        self.catch_up()  # a batch the live stream lost with nothing after it

    def catch_up(self) -> None:
        for seq, payload in replay(self.ctx, self.replay_url, self.next_seq):
            self.apply(seq, payload)
