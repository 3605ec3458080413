"""KV between workers that split the heads differently, moved as whole blocks through a
staging buffer laid out as the other side's shards.

With the KV laid out (block, token, head, dim), a slice of heads is contiguous only within one
token: moved straight, it is one NIXL descriptor per token slot per K/V per layer, and UCX's
cma transport makes one system call per descriptor (80-100x slower than whole blocks,
docs/benchmarks.md "KV between TP sizes"). Staged, each transfer moves blocks whole:
- pull (D): the READ lands the needed peer shards' blocks in a buffer laid out as those shards;
  `Staged.scatter` copies each layer's runs of heads into our shards as the forward's wait for
  that layer returns;
- push (P): `Staged.gather` copies a layer's runs of heads from our shards into a buffer laid
  out as the peer's shards (each head once) before that layer's WRITE, which moves it whole.
A staging layout is a `KVLayout` of the other side's shard structure at our buffer's addresses,
so the same descriptor code (layout.py) gives whole blocks. A buffer is registered with our
NIXL agent once, kept for reuse (the `keep` largest), and never reused or freed before every
transfer through it has settled.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.kv_cache.tensors import huge_page_zeros
from common.kv_transfer.layout import KVLayout, KVShard, ShardTensors, head_routes, runs

Routes = tuple[tuple[int, int, int, int], ...]  # (dest shard, src shard, first head, count)


@dataclass(eq=False)  # one buffer is itself: == would compare the tensors elementwise
class _Buffer:
    tensor: torch.Tensor  # uint8
    registration: object


@dataclass
class Staged:
    """One transfer's staging: `layout` is the other side's shards at our buffer's addresses."""

    layout: KVLayout
    views: list[list[torch.Tensor]]  # per staging shard, per layer: (2, n, block, heads, dim)
    routes: Routes  # pull: (our shard, staging shard, ...); push: (staging shard, our shard, ...)
    buffer: _Buffer
    futures: list[Future] = field(default_factory=list)

    def scatter(self, layer: int, shards: list[ShardTensors], blocks: list[int]) -> None:
        """Pull: this layer's heads from the buffer into our shards' `blocks`."""
        for d, k, first, count in self.routes:
            self._copy(layer, shards[d], k, first, count, blocks, into_ours=True)

    def gather(self, layer: int, shards: list[ShardTensors], blocks: list[int]) -> None:
        """Push: this layer's heads of our shards' `blocks` into the buffer."""
        for k, s, first, count in self.routes:
            self._copy(layer, shards[s], k, first, count, blocks, into_ours=False)

    def _copy(self, layer, ours: ShardTensors, k, first, count, blocks, into_ours: bool) -> None:
        """One strided copy per run of consecutive block ids (usually one)."""
        mine = first - ours.first_head
        theirs = first - self.layout.shards[k].first_head
        staged = self.views[k][layer][:, :, :, theirs : theirs + count]
        kv = ours.kv_caches[layer][:, :, :, mine : mine + count]
        for start, at, n in runs(blocks, range(len(blocks))):
            if into_ours:
                kv[:, start : start + n].copy_(staged[:, at : at + n])
            else:
                staged[:, at : at + n].copy_(kv[:, start : start + n])


class StagingPool:
    def __init__(self, transport, shards: list[ShardTensors], keep: int = 2):
        self.transport = transport
        self.shards = shards  # ours, every rank's
        self.keep = keep
        self._free: list[_Buffer] = []
        self._busy: list[Staged] = []

    def for_read(self, peer: KVLayout, num_blocks: int) -> Staged | None:
        """A staging buffer for reading `num_blocks` blocks from `peer`; None where every run
        of heads is a whole shard on both sides (straight into our blocks), and on CUDA (not
        built there: head-sliced descriptors)."""
        ours = self.transport.layout
        routes = head_routes(ours, peer)
        if not num_blocks or ours.device != "cpu" or _whole(routes, ours, peer):
            return None
        used = sorted({s for _, s, _, _ in routes})
        staged = self._staged([peer.shards[s] for s in used], num_blocks)
        staged.routes = tuple((d, used.index(s), first, n) for d, s, first, n in routes)
        return staged

    def for_write(self, peer: KVLayout, num_blocks: int) -> Staged | None:
        """A staging buffer for writing `num_blocks` blocks to `peer`, laid out as the peer's
        shards that hold each head once (a replicated head is written from one copy); None
        as for `for_read`."""
        ours = self.transport.layout
        if not num_blocks or ours.device != "cpu" or _whole(head_routes(peer, ours), peer, ours):
            return None
        distinct, held = [], set()
        for shard in peer.shards:
            if not set(shard.heads) & held:
                distinct.append(shard)
                held |= set(shard.heads)
        staged = self._staged(distinct, num_blocks)
        staged.routes = head_routes(staged.layout, ours)
        return staged

    def _staged(self, like: list[KVShard], num_blocks: int) -> Staged:
        ours = self.transport.layout
        layers, block, dim = ours.num_layers, ours.block_size, ours.head_dim
        sizes = [layers * 2 * num_blocks * block * s.num_heads * dim for s in like]
        buffer = self._take(sum(sizes) * ours.elem_size)
        flat = buffer.tensor[: sum(sizes) * ours.elem_size].view(getattr(torch, ours.dtype))
        views, shards, offset = [], [], 0
        for shard, size in zip(like, sizes, strict=True):
            shape = (layers, 2, num_blocks, block, shard.num_heads, dim)
            per_layer = list(flat[offset : offset + size].view(shape).unbind(0))
            views.append(per_layer)
            addrs = tuple(t.data_ptr() for t in per_layer)
            shards.append(KVShard(shard.first_head, shard.num_heads, addrs))
            offset += size
        layout = KVLayout(**{**ours.__dict__, "shards": tuple(shards), "num_blocks": num_blocks})
        staged = Staged(layout, views, (), buffer)
        self._busy.append(staged)
        return staged

    def _take(self, num_bytes: int) -> _Buffer:
        fits = [b for b in self._free if b.tensor.numel() >= num_bytes]
        if fits:
            buffer = min(fits, key=lambda b: b.tensor.numel())
            self._free.remove(buffer)
            return buffer
        tensor = huge_page_zeros((num_bytes,), torch.uint8)  # touched: no faults under a copy
        return _Buffer(tensor, self.transport.register(tensor))

    def settle(self) -> None:
        """Buffers whose transfers have all settled go back to the pool (the `keep` largest);
        between steps, when every transfer through a buffer has been posted."""
        still = []
        for staged in self._busy:
            if not all(_settled(f) for f in staged.futures):
                still.append(staged)
                continue
            self._free.append(staged.buffer)
        self._busy = still
        self._free.sort(key=lambda b: -b.tensor.numel())
        for buffer in self._free[self.keep :]:
            self.transport.deregister(buffer.registration)
        del self._free[self.keep :]

    def __len__(self) -> int:
        return len(self._busy)


def _whole(routes: Routes, dest: KVLayout, src: KVLayout) -> bool:
    """Every run of heads is a whole shard on both sides: blocks move whole without staging."""
    return all(
        count == dest.shards[d].num_heads == src.shards[s].num_heads for d, s, _, count in routes
    )


def _settled(future: Future) -> bool:
    is_settled = getattr(future, "is_settled", None)
    return future.done() if is_settled is None else is_settled()
