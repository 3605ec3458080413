"""The KV layout a peer needs to address a worker's paged KV cache over NIXL.

A worker's KV is one or more shards (`KVShard`): a tensor-parallel rank's KV heads, per layer
one contiguous tensor (2, num_blocks, block_size, num_heads, head_dim). A worker at TP 1 has one
shard holding every head. The K bytes of block b of a shard's layer l start at
base_addrs[l] + b * block_len, its V bytes num_blocks blocks later.

A transfer pairs each of our shards' heads with a peer shard that holds them (`head_routes`):
- the same heads on both sides (equal TP sizes): blocks b..b+n-1 are one run of n * block_len
  bytes in each of K and V, so a transfer moves one descriptor per run per K/V, whatever the
  number of blocks (`runs`);
- different heads (P and D at different TP sizes): a token's heads are contiguous, a block's
  heads of one shard are not, so one descriptor per token per K/V moves that token's slice of
  heads (head-sliced descriptors, docs/design.md "KV between TP sizes").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


@dataclass(frozen=True)
class ShardTensors:
    """A rank's KV tensors (one per layer), holding KV heads first_head.. of the model."""

    first_head: int
    kv_caches: Sequence[torch.Tensor]


@dataclass(frozen=True)
class KVShard:
    """KV heads [first_head, first_head + num_heads) of every layer; layer l at base_addrs[l]."""

    first_head: int
    num_heads: int
    base_addrs: tuple[int, ...]

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)


@dataclass(frozen=True)
class KVLayout:
    """What a peer needs to address our KV cache; JSON-serialisable via to_dict / from_dict."""

    engine_id: str
    agent_name: str
    shards: tuple[KVShard, ...]
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's
    head_dim: int
    dtype: str
    elem_size: int
    device: str  # "cpu" | "cuda"
    device_id: int = 0

    def __post_init__(self) -> None:
        for shard in self.shards:
            if len(shard.base_addrs) != self.num_layers:
                raise ValueError(
                    f"{len(shard.base_addrs)} base addresses for {self.num_layers} layers"
                )
            if shard.first_head < 0 or shard.heads.stop > self.num_kv_heads:
                raise ValueError(f"shard heads {shard.heads} outside {self.num_kv_heads} heads")
        if self.device not in _MEM_TYPES:
            raise ValueError(f"device must be one of {sorted(_MEM_TYPES)}, got {self.device!r}")

    @property
    def mem_type(self) -> str:
        return _MEM_TYPES[self.device]

    @property
    def tp_size(self) -> int:
        return len(self.shards)

    def block_len(self, shard: KVShard) -> int:
        """Bytes of one block's K (or V) of one layer of `shard`."""
        return self.block_size * self.token_len(shard)

    def token_len(self, shard: KVShard) -> int:
        return shard.num_heads * self.head_dim * self.elem_size

    @classmethod
    def of(
        cls,
        engine_id: str,
        agent_name: str,
        kv: Sequence[torch.Tensor] | Sequence[ShardTensors],
        num_kv_heads: int | None = None,
    ) -> KVLayout:
        """The layout of one shard's tensors (every head), or of several (`ShardTensors`)."""
        shards = as_shards(kv)
        for shard in shards:
            check_kv_caches(shard.kv_caches)
        first = shards[0].kv_caches[0]
        _, num_blocks, block_size, _, head_dim = first.shape
        for shard in shards:
            t = shard.kv_caches[0]
            if (len(shard.kv_caches), t.shape[1], t.shape[2], t.shape[4], t.dtype) != (
                len(shards[0].kv_caches),
                num_blocks,
                block_size,
                head_dim,
                first.dtype,
            ):
                raise ValueError("every shard needs the same layers, blocks, head dim and dtype")
        return cls(
            engine_id=engine_id,
            agent_name=agent_name,
            shards=tuple(
                KVShard(
                    s.first_head, s.kv_caches[0].shape[3], tuple(t.data_ptr() for t in s.kv_caches)
                )
                for s in shards
            ),
            num_blocks=num_blocks,
            num_layers=len(shards[0].kv_caches),
            block_size=block_size,
            num_kv_heads=num_kv_heads
            or max(s.first_head + s.kv_caches[0].shape[3] for s in shards),
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
            elem_size=first.element_size(),
            device=first.device.type,
            device_id=first.device.index or 0,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shards"] = [{**s, "base_addrs": list(s["base_addrs"])} for s in data["shards"]]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        shards = tuple(
            KVShard(s["first_head"], s["num_heads"], tuple(s["base_addrs"])) for s in data["shards"]
        )
        return cls(**{**data, "shards": shards})

    def check_peer(self, peer: KVLayout) -> None:
        """ValueError, naming both sides, unless `peer`'s shards can fill ours and be filled
        from ours: the same layers, block size, head size and dtype, and every head held."""
        ours = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        theirs = (peer.num_layers, peer.block_size, peer.num_kv_heads, peer.head_dim, peer.dtype)
        if ours != theirs:
            raise ValueError(
                f"peer {peer.engine_id} has (layers, block size, KV heads, head dim, dtype) "
                f"{theirs}; we have {ours}"
            )
        head_routes(self, peer)
        head_routes(peer, self)

    def region_descs(self) -> np.ndarray:
        """One (addr, len, device id) row per shard per layer's whole tensor: what must be
        registered."""
        rows = [
            (addr, 2 * self.num_blocks * self.block_len(shard), self.device_id)
            for shard in self.shards
            for addr in shard.base_addrs
        ]
        return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)

    def check_blocks(self, starts: Sequence[int], block_runs: list[tuple[int, int, int]]) -> None:
        for start, (_, _, n) in zip(starts, block_runs, strict=True):
            if start < 0 or start + n > self.num_blocks:
                raise ValueError(
                    f"block ids out of range [0, {self.num_blocks}) for {self.engine_id}"
                )

    def block_descs(
        self, shard: KVShard, layers: np.ndarray, starts: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray:
        """(addr, len, device id) rows: per layer, the K bytes of each run of whole blocks
        (`starts`, `lengths` in blocks), then their V bytes."""
        block_len = np.uint64(self.block_len(shard))
        offsets = np.concatenate([starts, starts + np.uint64(self.num_blocks)]) * block_len
        sizes = np.concatenate([lengths, lengths]) * block_len
        return self._rows(shard, layers, offsets, sizes)

    def token_descs(
        self, shard: KVShard, layers: np.ndarray, tokens: np.ndarray, first_head: int, count: int
    ) -> np.ndarray:
        """(addr, len, device id) rows: per layer, the K bytes of heads first_head..+count of
        each token slot in `tokens` (block * block_size + offset), then their V bytes."""
        token_len = np.uint64(self.token_len(shard))
        plane = np.uint64(self.num_blocks * self.block_size) * token_len
        head = np.uint64((first_head - shard.first_head) * self.head_dim * self.elem_size)
        offsets = np.concatenate([tokens * token_len, plane + tokens * token_len]) + head
        size = count * self.head_dim * self.elem_size
        return self._rows(shard, layers, offsets, np.full(offsets.size, size, dtype=np.uint64))

    def _rows(
        self, shard: KVShard, layers: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
    ) -> np.ndarray:
        descs = np.empty((layers.size, offsets.size, 3), dtype=np.uint64)
        descs[:, :, 0] = _bases(shard)[layers][:, None] + offsets[None, :]
        descs[:, :, 1] = sizes[None, :]
        descs[:, :, 2] = self.device_id
        return descs.reshape(-1, 3)


@functools.lru_cache(maxsize=256)
def _bases(shard: KVShard) -> np.ndarray:
    return np.asarray(shard.base_addrs, dtype=np.uint64)


@functools.lru_cache(maxsize=256)
def head_routes(dest: KVLayout, src: KVLayout) -> tuple[tuple[int, int, int, int], ...]:
    """How `src`'s shards fill `dest`'s: (dest shard, src shard, first head, count) per run of
    heads of a dest shard that one src shard holds (the first that does, when heads are
    replicated). ValueError naming both sides when a head of dest is held by no src shard."""
    routes: list[list[int]] = []
    for d, shard in enumerate(dest.shards):
        for head in shard.heads:
            s = next((i for i, peer in enumerate(src.shards) if head in peer.heads), None)
            if s is None:
                raise ValueError(
                    f"KV head {head} of {dest.engine_id} (shards {_heads(dest)}) is held by no "
                    f"shard of {src.engine_id} (shards {_heads(src)})"
                )
            last = routes[-1] if routes else None
            if last is not None and last[:2] == [d, s] and last[2] + last[3] == head:
                last[3] += 1
            else:
                routes.append([d, s, head, 1])
    return tuple(tuple(r) for r in routes)


def _heads(layout: KVLayout) -> str:
    return ", ".join(f"{s.first_head}-{s.heads.stop - 1}" for s in layout.shards)


def transfer_descs(
    local: KVLayout,
    remote: KVLayout,
    layers: Sequence[int],
    block_runs: list[tuple[int, int, int]],
    dest_is_local: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """(local rows, remote rows) of (addr, len, device id): row i here moves to or from row i
    there. `block_runs` as `runs` gives them (local start, remote start, length); the heads of
    every shard of the destination side come from the source shard that holds them. Whole
    blocks where both shards hold the same heads, token by token otherwise. O(layers x runs)
    in numpy for whole blocks, O(layers x tokens) for head slices; nothing per block in Python."""
    layer_ids = np.asarray(layers, dtype=np.int64)
    if layer_ids.size and (layer_ids.min() < 0 or layer_ids.max() >= local.num_layers):
        raise ValueError(f"layer {list(layers)} out of range [0, {local.num_layers})")
    local.check_blocks([r[0] for r in block_runs], block_runs)
    remote.check_blocks([r[1] for r in block_runs], block_runs)
    starts = [np.array([r[i] for r in block_runs], dtype=np.uint64) for i in (0, 1)]
    lengths = np.array([r[2] for r in block_runs], dtype=np.uint64)
    dest, src = (local, remote) if dest_is_local else (remote, local)
    here, there = [], []
    for d, s, first, count in head_routes(dest, src):
        pair = (
            (local.shards[d], remote.shards[s])
            if dest_is_local
            else (local.shards[s], remote.shards[d])
        )
        if count == pair[0].num_heads == pair[1].num_heads:  # the same heads: whole blocks
            for side, layout, shard, rows in (
                (0, local, pair[0], here),
                (1, remote, pair[1], there),
            ):
                rows.append(layout.block_descs(shard, layer_ids, starts[side], lengths))
            continue
        for side, layout, shard, rows in ((0, local, pair[0], here), (1, remote, pair[1], there)):
            tokens = _token_slots(block_runs, side, local.block_size)
            rows.append(layout.token_descs(shard, layer_ids, tokens, first, count))
    empty = np.empty((0, 3), dtype=np.uint64)
    return (np.concatenate(here) if here else empty), (np.concatenate(there) if there else empty)


def _token_slots(block_runs: list[tuple[int, int, int]], side: int, block_size: int) -> np.ndarray:
    if not block_runs:
        return np.empty(0, dtype=np.uint64)
    return np.concatenate(
        [np.arange(r[side] * block_size, (r[side] + r[2]) * block_size) for r in block_runs]
    ).astype(np.uint64)


def as_shards(kv: Sequence[torch.Tensor] | Sequence[ShardTensors]) -> list[ShardTensors]:
    """`kv` as shards: a plain list of layer tensors is one shard holding every head."""
    if kv and isinstance(kv[0], ShardTensors):
        return list(kv)
    return [ShardTensors(0, list(kv))]


def runs(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) of each maximal run where both the local and the
    remote block ids go up by one: [3, 4, 5, 9] -> [7, 8, 9, 2] is [(3, 7, 3), (9, 2, 1)]."""
    local, remote = list(local_blocks), list(remote_blocks)
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks but {len(remote)} remote")
    if not local:
        return []
    n = len(local)
    if local == list(range(local[0], local[0] + n)) and remote == list(
        range(remote[0], remote[0] + n)
    ):
        return [(local[0], remote[0], n)]  # the allocator's usual case
    found = [[local[0], remote[0], 1]]
    for lb, rb in zip(local[1:], remote[1:], strict=True):
        last = found[-1]
        if lb == last[0] + last[2] and rb == last[1] + last[2]:
            last[2] += 1
        else:
            found.append([lb, rb, 1])
    return [(lb, rb, length) for lb, rb, length in found]


def check_kv_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    if not kv_caches:
        raise ValueError("no KV cache tensors")
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[0] != 2:
        raise ValueError(
            f"expected (2, num_blocks, block_size, heads, head_dim), got {first.shape}"
        )
    for t in kv_caches:
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise ValueError("all layers' KV tensors must share shape, dtype and device")
        if not t.is_contiguous():
            raise ValueError("KV cache tensors must be contiguous")


def registration_regions(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(addr, bytes) to register: layers that are adjacent views of one storage become one
    region (UCX then looks up one memory key for a READ of every layer, not one per layer:
    ~25% faster at 512 tokens here); separate allocations stay separate regions."""
    spans = sorted(
        (t.data_ptr(), t.numel() * t.element_size(), t.untyped_storage().data_ptr())
        for t in tensors
    )
    regions: list[list[int]] = []
    for addr, size, storage in spans:
        last = regions[-1] if regions else None
        if last is not None and last[2] == storage and last[0] + last[1] == addr:
            last[1] += size
        else:
            regions.append([addr, size, storage])
    return [(addr, size) for addr, size, _ in regions]


def distinct_heads(shards: Sequence[ShardTensors]) -> list[ShardTensors]:
    """The shards that hold each head once between them: the split ones, or the first of those
    that replicate a head."""
    kept: list[ShardTensors] = []
    held: set[int] = set()
    for shard in shards:
        heads = set(range(shard.first_head, shard.first_head + shard.kv_caches[0].shape[3]))
        if not heads & held:
            kept.append(shard)
            held |= heads
    return kept
