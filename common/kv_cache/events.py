"""KV cache events in vLLM's wire format, and the collector the prefix cache records them into.

The shapes are vLLM 0.32's (`vllm/distributed/kv_events.py`), so routers that read vLLM's
events (vllm-router's `kv_aware` policy, Dynamo, llm-d) read ours. msgpack, via msgspec:

    batch:  [ts, events, data_parallel_rank]                   (array_like)
    event:  {"type": "BlockStored", "block_hashes": [...], ...}  (a map, tagged by class name)

`BlockStored` covers a run of consecutive blocks of one prefix chain: `parent_block_hash` is the
hash of the block before the first (None for a prompt's first block) and `token_ids` holds
`block_size` tokens per block. Hashes go out as unsigned 64-bit ints (`external_hash`: the
last 8 bytes of our 32-byte key, as vLLM sends its sha256 keys by default), which consumers read
(vllm-router rejects negatives). They name blocks in events only: a worker finds a block by its
full key, so two keys that share their last 8 bytes can mislead a router, never a lookup.

A salted chain's first block carries `extra_keys` `[("cache_salt", tag)]`, where vLLM would put
the salt itself: `tag` names the salt without revealing it (common/kv_cache/block_hash.py), so
that a router can tell salted chains apart (proxy/kv_index.py roots them there) while a reader
of the events cannot hit them.

The block pool (removals, resets) and the cache manager (stored blocks) record into a
`KVEventCollector` when one is attached (`BlockPool.events`); the engine thread takes the
events once per step and hands them to the publisher as one batch.
"""

from __future__ import annotations

import msgspec

from common.kv_cache.block_hash import BlockHash, salt_tag

# NOTE: vLLM reports its primary KV cache as "GPU" on every device, its CPU build included; "CPU"
# is its offloading tier, which routers discount. Ours is the primary cache wherever it lives.
MEDIUM = "GPU"


SALT_KEY = "cache_salt"  # extra_keys of a salted chain's first block: (SALT_KEY, its tag)


def external_hash(block_hash: BlockHash) -> int:
    """Our block key as the u64 consumers expect (its last 8 bytes, big-endian, as vLLM's)."""
    return int.from_bytes(block_hash[-8:], "big")


def salt_extra_keys(cache_salt: str | None) -> tuple[str, str] | None:
    """What a chain's first block carries in `extra_keys`: None without a salt."""
    return None if cache_salt is None else (SALT_KEY, salt_tag(cache_salt))


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A prefix-cache change; encoded as a map with the class name under "type"."""


class BlockStored(KVCacheEvent):
    # vLLM's field order; fields after group_idx (cache-spec kind, locality, ownership, session)
    # are omitted on the wire when unset, as they are here.
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None  # one entry per block; None: no extra keys
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventCollector:
    """The prefix cache's changes since the last `take`, in order.

    Consecutive stores of one chain merge into one `BlockStored` (as vLLM emits one per cached
    run) and consecutive removals into one `BlockRemoved`; a clear makes what came before moot.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: list[int],
        extra_keys: tuple | None = None,
    ) -> None:
        """`extra_keys`: `salt_extra_keys` for a salted chain's first block."""
        assert len(token_ids) == self.block_size, "a stored block is a full block"
        block_hash = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent == last.block_hashes[-1]:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            last.extra_keys.append(extra_keys)
            return
        self._events.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                extra_keys=[extra_keys],  # [None]: what vLLM sends for a plain-text block
                group_idx=0,
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_hash(block_hash)], MEDIUM, group_idx=0))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
