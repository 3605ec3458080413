"""Per-request block tables on top of the block pool.

The scheduler asks three things: how much of a prompt is already cached (`get_computed_blocks`),
room for the tokens it is about to compute (`allocate_slots`), and to give a request's blocks
back (`free`). Full blocks are hashed as a chain (each hash covers its block's tokens and every
token before it), so a hit on block i implies hits on blocks 0..i-1; the chain starts at a root
that covers the model and the request's `cache_salt` (common/kv_cache/block_hash.py).
"""

from __future__ import annotations

from typing import Protocol

from common.kv_cache.block_hash import BlockHash, chain_hashes, hash_block, root_hash
from common.kv_cache.block_pool import Block, BlockPool
from common.kv_cache.events import salt_extra_keys

__all__ = ["CacheSeq", "KVCacheManager", "chain_hashes", "hash_block"]


class CacheSeq(Protocol):
    request_id: str
    blocks: list[Block]
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    cache_salt: str | None  # its chain's own root: shares blocks only with the same salt

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, namespace: str = ""):
        """`namespace`: the model's identity, in every block's key (the KV compatibility hash
        in a worker)."""
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace
        self._root = root_hash(namespace)  # of every request without a salt

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: CacheSeq) -> tuple[list[Block], int]:
        """Cached leading blocks of a new sequence and the number of tokens they hold.

        At least one token is always left to compute: its logits give the next token.
        """
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = self.pool.lookup(seq.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def take_cached_prefix(
        self, token_ids: list[int], cache_salt: str | None = None
    ) -> list[Block]:
        """The cached leading blocks of a prompt, at most all but its last token, each now
        referenced for the caller (who frees them): what a reader may copy while they are held."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        prefix = token_ids[: max_blocks * self.block_size]
        hashes = chain_hashes(prefix, self.block_size, [], self.root(cache_salt))
        hits = self.pool.lookup(hashes, count=False)
        self.pool.touch(hits)
        return hits

    def allocate_slots(
        self, seq: CacheSeq, num_new_tokens: int, computed: list[Block] | None = None
    ) -> bool:
        """Make the block table cover `num_computed_tokens + num_new_tokens`; False if the pool
        cannot (nothing is taken then)."""
        computed = computed or []
        have = len(seq.blocks) + len(computed)
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - have
        evictable_hits = sum(1 for b in computed if b.ref_count == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        self.pool.touch(computed)
        seq.blocks.extend(computed)
        last = seq.blocks[-1].block_id if seq.blocks else None
        seq.blocks.extend(self.pool.allocate(max(need, 0), after=last))
        return True

    def cache_full_blocks(self, seq: CacheSeq, num_computed_tokens: int) -> None:
        """Register the blocks that became full and computed."""
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq)
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i, (block, block_hash) in enumerate(zip(seq.blocks[:num_full], seq.block_hashes)):
            if self.pool.cache(block, block_hash) and self.pool.events is not None:
                self._record_stored(seq, i)

    def _record_stored(self, seq: CacheSeq, i: int) -> None:
        """A KV event for block i of `seq`, newly in the prefix cache."""
        parent = seq.block_hashes[i - 1] if i else None
        tokens = seq.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
        extra_keys = None if i else salt_extra_keys(seq.cache_salt)
        self.pool.events.stored(seq.block_hashes[i], parent, tokens, extra_keys)

    def free(self, seq: CacheSeq) -> None:
        self.pool.free(list(reversed(seq.blocks)))
        seq.blocks.clear()

    def root(self, cache_salt: str | None) -> BlockHash:
        """The parent of a first block: the model's, and the salt's when there is one."""
        return self._root if cache_salt is None else root_hash(self.namespace, cache_salt)

    def _update_hashes(self, seq: CacheSeq) -> None:
        """Extend the sequence's hash chain over the full blocks it has now."""
        tokens, hashes = seq.all_token_ids, seq.block_hashes
        if len(tokens) // self.block_size > len(hashes):
            root = hashes[-1] if hashes else self.root(seq.cache_salt)  # a salted one: once
            chain_hashes(tokens, self.block_size, hashes, root)
