"""Staged transfers between different head splits (common/kv_transfer/nixl/staging.py), over two
real NIXL agents in this process: pulled, the peer's blocks land whole in a staging buffer and
each head ends up in our shard that holds it; pushed, our heads are gathered into the peer's
layout and written whole. Nothing outside the named blocks changes; buffers are reused and go
back to the pool once their transfers have settled."""

from __future__ import annotations

import contextlib
import os
import random
from concurrent.futures import Future

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
pytest.importorskip("nixl")

from common.kv_transfer.layout import ShardTensors  # noqa: E402
from common.kv_transfer.nixl.staging import StagingPool  # noqa: E402
from common.kv_transfer.nixl.transport import NixlTransport  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 12, 4, 8
SPLITS = {"tp1": [(0, 3)], "tp2": [(0, 1), (1, 3)], "tp2-other": [(0, 2), (2, 3)]}


def shards(split: str, fill: bool) -> list[ShardTensors]:
    out = []
    for first, stop in SPLITS[split]:
        shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, stop - first, HEAD_DIM)
        kv = torch.randn(shape) if fill else torch.zeros(shape)
        out.append(ShardTensors(first, list(kv.unbind(0))))
    return out


def heads_of(kv: list[ShardTensors], layer: int, blocks: list[int]) -> torch.Tensor:
    """The named blocks of a layer, every head once in head order."""
    by_head = {}
    for shard in kv:
        t = shard.kv_caches[layer][:, blocks]
        for i in range(t.shape[3]):
            by_head.setdefault(shard.first_head + i, t[:, :, :, i])
    return torch.stack([by_head[h] for h in sorted(by_head)], dim=3)


SPLIT_PAIRS = [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2-other"), ("tp1", "tp1")]


@contextlib.contextmanager
def connected(p_split: str, d_split: str):
    """P's shards (random) and D's (zero), each behind its own agent, each knowing the other."""
    p_kv, d_kv = shards(p_split, fill=True), shards(d_split, fill=False)
    with NixlTransport("p", p_kv) as p, NixlTransport("d", d_kv) as d:
        d.add_peer(p.layout, p.metadata())
        p.add_peer(d.layout, d.metadata())
        yield p_kv, d_kv, p, d


@pytest.mark.parametrize("p_split, d_split", SPLIT_PAIRS)
def test_a_staged_pull_puts_every_head_where_it_belongs(p_split, d_split):
    with connected(p_split, d_split) as (p_kv, d_kv, p, d):
        pool = StagingPool(d, d_kv)
        local, remote = [2, 3, 4, 9], [7, 8, 0, 1]
        staged = pool.for_read(p.layout, len(local))
        if p_split == d_split:  # the same heads on both sides: straight into our blocks
            assert staged is None
            return
        future = d.read_layers("p", range(LAYERS), range(len(local)), remote, via=staged.layout)
        staged.futures.append(future)
        result = future.result(timeout=10)
        assert result.num_descriptors == 2 * len(staged.layout.shards) * LAYERS * 2  # 2 runs
        for layer in range(LAYERS):
            staged.scatter(layer, d_kv, local)
            assert torch.equal(heads_of(d_kv, layer, local), heads_of(p_kv, layer, remote))
            others = [b for b in range(BLOCKS) if b not in local]
            assert all(not s.kv_caches[layer][:, others].any() for s in d_kv)
        assert len(pool) == 1
        pool.settle()
        assert len(pool) == 0 and len(pool._free) == 1
        buffer = pool._free[0]
        again = pool.for_read(p.layout, 2)  # fits in the same buffer: reused, not registered anew
        assert again.buffer is buffer and not pool._free
        again.futures.append(d.read_layers("p", range(LAYERS), [0, 1], [5, 6], via=again.layout))
        again.futures[0].result(timeout=10)
        pool.settle()
        assert pool._free == [buffer]
        pool.settle()
        for b in pool._free:
            d.deregister(b.registration)


@pytest.mark.parametrize("p_split, d_split", SPLIT_PAIRS)
def test_a_staged_push_writes_every_head_where_the_peer_holds_it(p_split, d_split):
    with connected(p_split, d_split) as (p_kv, d_kv, p, d):
        pool = StagingPool(p, p_kv)
        local, remote = [5, 6, 7, 0], [1, 2, 3, 11]
        staged = pool.for_write(d.layout, len(local))
        if p_split == d_split:
            assert staged is None
            return
        for layer in range(LAYERS):  # as P does: gather a layer once its KV is written, WRITE
            staged.gather(layer, p_kv, local)
            staged.futures.append(
                p.write_layer("d", layer, range(len(local)), remote, via=staged.layout)
            )
        results = [f.result(timeout=10) for f in staged.futures]
        assert all(r.num_descriptors == 2 * len(staged.layout.shards) * 2 for r in results)
        for layer in range(LAYERS):
            assert torch.equal(heads_of(d_kv, layer, remote), heads_of(p_kv, layer, local))
            others = [b for b in range(BLOCKS) if b not in remote]
            assert all(not s.kv_caches[layer][:, others].any() for s in d_kv)
        pool.settle()
        assert len(pool) == 0 and len(pool._free) == 1


# rounds of transfers in flight together, each a number of blocks: buffers of several sizes
# taken while others are busy, then freed in a shuffled order (the pool holds two sizes)
ROUNDS = [[3], [1, 4], [2], [4, 1, 3], [1], [2, 4]]


@pytest.mark.parametrize("p_split, d_split", [("tp2", "tp1"), ("tp1", "tp2")])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_buffers_of_several_sizes_are_taken_and_freed_in_any_order(p_split, d_split, direction):
    gen = random.Random(11)
    with connected(p_split, d_split) as (p_kv, d_kv, p, d):
        ours, kv = (d, d_kv) if direction == "pull" else (p, p_kv)
        pool = StagingPool(ours, kv)
        for sizes in ROUNDS:
            picked = gen.sample(range(BLOCKS), sum(sizes))  # disjoint blocks within a round
            gates = []
            for n in sizes:
                local, remote = picked[:n], gen.sample(range(BLOCKS), n)
                picked = picked[n:]
                move = _staged_pull if direction == "pull" else _staged_push
                staged = move(pool, p, d, p_kv, d_kv, local, remote)
                gates.append(Future())  # the pool frees a buffer once its last future settles
                staged.futures.append(gates[-1])
            for gate in gen.sample(gates, len(gates)):
                gate.set_result(None)
                pool.settle()
            assert len(pool) == 0 and 1 <= len(pool._free) <= pool.keep
        for buffer in pool._free:
            ours.deregister(buffer.registration)


def _staged_pull(pool, p, d, p_kv, d_kv, local, remote):
    staged = pool.for_read(p.layout, len(local))
    future = d.read_layers("p", range(LAYERS), range(len(local)), remote, via=staged.layout)
    staged.futures.append(future)
    future.result(timeout=10)
    for layer in range(LAYERS):
        staged.scatter(layer, d_kv, local)
        assert torch.equal(heads_of(d_kv, layer, local), heads_of(p_kv, layer, remote))
    return staged


def _staged_push(pool, p, d, p_kv, d_kv, local, remote):
    staged = pool.for_write(d.layout, len(local))
    for layer in range(LAYERS):
        staged.gather(layer, p_kv, local)
        staged.futures.append(
            p.write_layer("d", layer, range(len(local)), remote, via=staged.layout)
        )
    for future in staged.futures:
        future.result(timeout=10)
    for layer in range(LAYERS):
        assert torch.equal(heads_of(d_kv, layer, remote), heads_of(p_kv, layer, local))
    return staged
