"""Pulls between workers that split the KV heads differently: read the peer's blocks whole into
a staging buffer, then copy each run of heads into our shards.

With the KV laid out (block, token, head, dim), a slice of heads is contiguous only within one
token: read straight into our shards, a pull is one NIXL descriptor per token slot per K/V per
layer, and UCX's cma transport makes one system call per descriptor (50-65x slower than whole
blocks, docs/benchmarks.md "KV between TP sizes"). Staged, the READ moves each needed peer
shard's blocks whole (2 descriptors per run per layer, like equal splits), into a buffer laid
out as the peer's shards; `Staged.scatter` then copies each layer's head runs into our shards
(a memory copy), as the forward's wait for that layer returns.

A buffer is registered with our NIXL agent once, kept for reuse (`keep`, the largest ones),
and never reused or freed before the READ that lands in it has settled.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from common.kv_cache.tensors import huge_page_zeros
from common.kv_transfer.layout import KVLayout, KVShard, ShardTensors, head_routes, runs


@dataclass
class _Buffer:
    tensor: torch.Tensor  # uint8
    registration: object


@dataclass
class Staged:
    """One pull's staging: `layout` is the peer's used shards at our buffer's addresses."""

    layout: KVLayout
    views: list[list[torch.Tensor]]  # per staging shard, per layer: (2, n, block, heads, dim)
    routes: tuple[tuple[int, int, int, int], ...]  # (our shard, staging shard, head, count)
    buffer: _Buffer
    future: Future | None = None

    def scatter(self, layer: int, shards: list[ShardTensors], blocks: list[int]) -> None:
        """Copy this layer's heads from the buffer into our shards' `blocks`: one strided copy
        per run of consecutive block ids (usually one) per run of heads."""
        block_runs = runs(blocks, range(len(blocks)))
        for d, k, first, count in self.routes:
            mine = first - shards[d].first_head
            theirs = first - self.layout.shards[k].first_head
            src = self.views[k][layer][:, :, :, theirs : theirs + count]
            dst = shards[d].kv_caches[layer][:, :, :, mine : mine + count]
            for start, at, n in block_runs:
                dst[:, start : start + n].copy_(src[:, at : at + n])


class StagingPool:
    def __init__(self, transport, shards: list[ShardTensors], keep: int = 2):
        self.transport = transport
        self.shards = shards
        self.keep = keep
        self._free: list[_Buffer] = []
        self._busy: list[Staged] = []

    def stage(self, peer: KVLayout, num_blocks: int) -> Staged | None:
        """A staging buffer for reading `num_blocks` blocks from `peer`; None where every run
        of heads is a whole shard on both sides (read straight into our blocks), and on CUDA
        (not built there: head-sliced descriptors)."""
        ours = self.transport.layout
        routes = head_routes(ours, peer)
        if ours.device != "cpu" or all(
            count == ours.shards[d].num_heads == peer.shards[s].num_heads
            for d, s, _, count in routes
        ):
            return None
        used = sorted({s for _, s, _, _ in routes})
        elem, layers = ours.elem_size, ours.num_layers
        sizes = [
            layers * 2 * num_blocks * ours.block_size * peer.shards[s].num_heads * ours.head_dim
            for s in used
        ]
        buffer = self._take(sum(sizes) * elem)
        flat = buffer.tensor[: sum(sizes) * elem].view(getattr(torch, ours.dtype))
        views, kv_shards, offset = [], [], 0
        for s, size in zip(used, sizes, strict=True):
            heads = peer.shards[s].num_heads
            shape = (layers, 2, num_blocks, ours.block_size, heads, ours.head_dim)
            per_layer = list(flat[offset : offset + size].view(shape).unbind(0))
            views.append(per_layer)
            kv_shards.append(
                KVShard(peer.shards[s].first_head, heads, tuple(t.data_ptr() for t in per_layer))
            )
            offset += size
        layout = KVLayout(**{**ours.__dict__, "shards": tuple(kv_shards), "num_blocks": num_blocks})
        staged_routes = tuple((d, used.index(s), first, n) for d, s, first, n in routes)
        staged = Staged(layout, views, staged_routes, buffer)
        self._busy.append(staged)
        return staged

    def _take(self, num_bytes: int) -> _Buffer:
        fits = [b for b in self._free if b.tensor.numel() >= num_bytes]
        if fits:
            buffer = min(fits, key=lambda b: b.tensor.numel())
            self._free.remove(buffer)
            return buffer
        tensor = huge_page_zeros((num_bytes,), torch.uint8)  # touched: no faults under the READ
        return _Buffer(tensor, self.transport.register(tensor))

    def settle(self) -> None:
        """Buffers whose READ has settled go back to the pool (the largest `keep` of them)."""
        still = []
        for staged in self._busy:
            if staged.future is not None and not _settled(staged.future):
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


def _settled(future: Future) -> bool:
    is_settled = getattr(future, "is_settled", None)
    return future.done() if is_settled is None else is_settled()
