"""The KV layout a peer needs to address a worker's paged KV cache over NIXL.

Per layer one contiguous tensor (2, num_blocks, block_size, num_kv_heads, head_dim): the K bytes
of block b of layer l start at base_addrs[l] + b * block_len, its V bytes num_blocks blocks
later. Descriptors are indexed (layer * 2 + kv) * num_blocks + block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


@dataclass(frozen=True)
class KVLayout:
    """What a peer needs to address our KV cache; JSON-serialisable via to_dict / from_dict."""

    engine_id: str
    agent_name: str
    base_addrs: tuple[int, ...]  # per layer: data_ptr of its (2, num_blocks, ...) tensor
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_len: int  # bytes of one block's K (or V) in one layer
    device: str  # "cpu" | "cuda"
    device_id: int = 0

    def __post_init__(self) -> None:
        if len(self.base_addrs) != self.num_layers:
            raise ValueError(f"{len(self.base_addrs)} base addresses for {self.num_layers} layers")
        if self.device not in _MEM_TYPES:
            raise ValueError(f"device must be one of {sorted(_MEM_TYPES)}, got {self.device!r}")

    @property
    def mem_type(self) -> str:
        return _MEM_TYPES[self.device]

    @classmethod
    def of(cls, engine_id: str, agent_name: str, kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        check_kv_caches(kv_caches)
        first = kv_caches[0]
        _, num_blocks, block_size, num_kv_heads, head_dim = first.shape
        return cls(
            engine_id=engine_id,
            agent_name=agent_name,
            base_addrs=tuple(t.data_ptr() for t in kv_caches),
            num_blocks=num_blocks,
            num_layers=len(kv_caches),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
            block_len=first[0, 0].numel() * first.element_size(),
            device=first.device.type,
            device_id=first.device.index or 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "base_addrs": list(self.base_addrs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{**data, "base_addrs": tuple(data["base_addrs"])})

    def block_descs(self) -> np.ndarray:
        """(num_layers * 2 * num_blocks, 3) rows of (addr, len, device id), in index order."""
        offsets = np.arange(2 * self.num_blocks, dtype=np.uint64) * np.uint64(self.block_len)
        addrs = np.asarray(self.base_addrs, dtype=np.uint64)[:, None] + offsets[None, :]
        descs = np.empty((addrs.size, 3), dtype=np.uint64)
        descs[:, 0], descs[:, 1], descs[:, 2] = addrs.reshape(-1), self.block_len, self.device_id
        return descs

    def layer_indices(self, layer: int, blocks: Sequence[int]) -> np.ndarray:
        """Descriptor indices of `blocks` in `layer`: all K blocks, then all V blocks."""
        ids = np.asarray(blocks, dtype=np.int64)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids out of range [0, {self.num_blocks}) for {self.engine_id}")
        k = layer * 2 * self.num_blocks + ids
        return np.concatenate([k, k + self.num_blocks]).astype(np.int32)


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
