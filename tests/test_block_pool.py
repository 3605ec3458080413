"""Block pool and per-request block tables: ref counts, prefix cache, contiguous allocation."""

from __future__ import annotations

import pytest

from common.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from common.kv_cache.manager import KVCacheManager


class Seq:
    def __init__(self, tokens, rid="s", cache_salt=None):
        self.request_id = rid
        self.blocks, self.block_hashes = [], []
        self.num_computed_tokens = 0
        self.all_token_ids = list(tokens)
        self.cache_salt = cache_salt

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocation_prefers_contiguous_runs():
    pool = BlockPool(16)
    a, b, c = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    assert ids(a) == [0, 1, 2, 3] and ids(b) == [4, 5, 6, 7]
    pool.free(b)
    d = pool.allocate(3)  # the hole of 4 fits a run of 3
    assert ids(d) == [4, 5, 6]
    e = pool.allocate(2, after=ids(c)[-1])  # right after the request's last block
    assert ids(e) == [12, 13]
    pool.free(a)
    f = pool.allocate(6)  # no run of 6: scattered, ascending
    assert ids(f) == [0, 1, 2, 3, 7, 14]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    for blocks in (c, d, e, f):
        pool.free(blocks)
    assert pool.is_all_free


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.touch(blocks)
    pool.free(blocks)
    assert pool.num_used_blocks == 2
    pool.free(blocks)
    assert pool.is_all_free
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks)


def test_prefix_hits_keep_one_token_to_compute_and_evict_lru():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, block_size=4)
    first = Seq(range(12))  # exactly three full blocks
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first, 12)
    first_ids = ids(first.blocks)
    kv.free(first)
    assert pool.is_all_free and pool.num_used_blocks == 0

    again = Seq(range(12))
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 8, "the last block is recomputed so the last token gets logits"
    longer = Seq(list(range(12)) + [99, 98])
    hits, num_cached = kv.get_computed_blocks(longer)
    assert num_cached == 12 and ids(hits) == first_ids
    longer.num_computed_tokens = num_cached
    assert kv.allocate_slots(longer, 2, hits)
    assert ids(longer.blocks)[:3] == first_ids and pool.num_used_blocks == 4

    other = Seq(range(100, 100 + 16))  # needs 4 blocks: 4 empties left, no eviction yet
    assert kv.allocate_slots(other, 16)
    assert pool.lookup([h for h in longer.block_hashes[:3]]) != []
    kv.free(longer)
    kv.free(other)
    big = Seq(range(200, 232))  # all 8 blocks: evicts the cached prefix
    assert kv.allocate_slots(big, 32)
    assert pool.lookup(longer.block_hashes[:1]) == []
    kv.free(big)
    assert pool.is_all_free


def test_allocate_slots_fails_without_taking_anything():
    pool = BlockPool(2)
    kv = KVCacheManager(pool, block_size=4)
    seq = Seq(range(12))
    assert not kv.allocate_slots(seq, 12)
    assert seq.blocks == [] and pool.is_all_free


def cached(kv: KVCacheManager, seq: Seq) -> Seq:
    """`seq` computed, its full blocks in the prefix cache, its blocks freed."""
    assert kv.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq, seq.num_tokens)
    kv.free(seq)
    return seq


def test_blocks_are_shared_only_under_the_same_salt_and_model():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4, namespace="model-a")
    cached(kv, Seq(range(13), cache_salt="tenant-1"))
    assert kv.get_computed_blocks(Seq(range(13), cache_salt="tenant-1"))[1] == 12
    assert kv.get_computed_blocks(Seq(range(13), cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(Seq(range(13)))[1] == 0  # no salt: not the salted blocks
    assert kv.take_cached_prefix(list(range(13))) == []  # D's lease and push reservation too
    assert len(kv.take_cached_prefix(list(range(13)), "tenant-1")) == 3
    cached(kv, Seq(range(13)))
    assert kv.get_computed_blocks(Seq(range(13)))[1] == 12  # without a salt: shared, as before
    other_model = KVCacheManager(pool, block_size=4, namespace="model-b")
    assert other_model.get_computed_blocks(Seq(range(13)))[1] == 0
