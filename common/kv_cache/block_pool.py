"""The pool of KV blocks: reference counts, prefix caching, contiguous allocation.

Every block is in exactly one of three states:
- empty: ref_count 0, no hash; allocatable at once;
- cached: ref_count 0 with a prefix hash (its key: common/kv_cache/block_hash.py); reusable by
  a prefix hit, evictable (LRU) when the empties run out;
- in use: ref_count > 0 (shared blocks of a common prefix have ref_count > 1).

Allocation prefers a contiguous run of block ids (NIXL merges descriptors of adjacent memory,
so contiguous blocks move as one transfer), first right after a request's last block.

With `events` set (a `KVEventCollector`, when KV events are published), a cached block that is
evicted is recorded as removed and a reset that empties the cache as cleared; the cache manager
records stored blocks (it knows their tokens). `take_events()` hands them over, once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.kv_cache.block_hash import BlockHash
from common.kv_cache.events import KVCacheEvent, KVEventCollector

_EMPTY, _TAKEN = 1, 0


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty = bytearray([_EMPTY]) * num_blocks  # one byte per block: a fast run search
        self._num_empty = num_blocks
        self._cached: OrderedDict[int, Block] = OrderedDict()  # evictable, LRU first
        self._by_hash: dict[BlockHash, Block] = {}
        self.num_hits = 0
        self.num_queries = 0
        self.events: KVEventCollector | None = None  # None: no KV events published

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (empty + evictable cached)."""
        return self._num_empty + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def is_all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks

    # -- allocate / free ----------------------------------------------------------------------
    def allocate(self, num: int, after: int | None = None) -> list[Block]:
        """Take `num` blocks (ref_count 1), contiguous when the pool allows."""
        if num > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num} blocks, {self.num_free_blocks} free")
        if num == 0:
            return []
        ids = self._find_run(num, after)
        if ids is None:
            ids = self._scatter(num)
        for i in ids:
            self._take(self.blocks[i])
        return [self.blocks[i] for i in ids]

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; pass them tail first so the tail evicts first."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._cached[block.block_id] = block
                else:
                    self._mark_empty(block.block_id)

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_count == 0:
                self._cached.pop(block.block_id)
            block.ref_count += 1

    # -- prefix cache ---------------------------------------------------------------------------
    def lookup(self, block_hashes: list[BlockHash], count: bool = True) -> list[Block]:
        """The longest run of leading hashes that are cached; `count`: in the hit rate."""
        hits: list[Block] = []
        if self.enable_prefix_caching:
            for h in block_hashes:
                block = self._by_hash.get(h)
                if block is None:
                    break
                hits.append(block)
        if count:
            self.num_queries += len(block_hashes)
            self.num_hits += len(hits)
        return hits

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash chain value; False if it was already
        registered, or its hash was (by another block)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self._by_hash:  # same content computed twice; keep the first
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Evict every cached block; blocks in use keep their hashes."""
        for block in list(self._cached.values()):
            self._evict(block)
        if self.events is not None and not self._by_hash:
            self.events.cleared()

    def cached_hashes(self) -> set[BlockHash]:
        """The hashes a prefix lookup can hit now (cached and in-use blocks)."""
        return set(self._by_hash)

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, oldest first."""
        return [] if self.events is None else self.events.take()

    # -- internals --------------------------------------------------------------------------
    def _find_run(self, num: int, after: int | None) -> list[int] | None:
        if after is not None:
            start = after + 1
            if self._empty[start : start + num] == bytes([_EMPTY]) * num:
                return list(range(start, start + num))
        start = self._empty.find(bytes([_EMPTY]) * num)
        return None if start < 0 else list(range(start, start + num))

    def _scatter(self, num: int) -> list[int]:
        ids: list[int] = []
        pos = self._empty.find(_EMPTY)
        while pos >= 0 and len(ids) < num:
            ids.append(pos)
            pos = self._empty.find(_EMPTY, pos + 1)
        while len(ids) < num:  # evict least recently used cached blocks
            block = next(iter(self._cached.values()))
            self._evict(block)
            ids.append(block.block_id)
        return sorted(ids)

    def _evict(self, block: Block) -> None:
        assert block.ref_count == 0, f"evicting block {block.block_id} in use"
        self._cached.pop(block.block_id)
        del self._by_hash[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None
        self._mark_empty(block.block_id)

    def _take(self, block: Block) -> None:
        assert block.ref_count == 0 and block.block_hash is None
        self._empty[block.block_id] = _TAKEN
        self._num_empty -= 1
        block.ref_count = 1

    def _mark_empty(self, block_id: int) -> None:
        self._empty[block_id] = _EMPTY
        self._num_empty += 1
