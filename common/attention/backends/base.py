"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    # True where a decode replayed as a CUDA graph costs what an eager one does: the backend
    # reads each context up to its length on the device (`seq_lens_tensor`), never up to the
    # Python bound in `seq_lens` (common/attention/metadata.py)
    decode_graphs: bool = False

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, block_size: int
    ) -> str | None:
        """None when the backend can run with these settings, else why not."""
        return None

    def warm_up(self, kv_caches: list[torch.Tensor], num_heads: int) -> None:
        """Compile what the backend compiles, at start-up (every layer's cache; `num_heads`
        query heads). Nothing by default."""
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write key/value into the cache, then attend.

        query (T, Hq, D), key/value (T, Hkv, D), kv_cache (2, num_blocks, block_size, Hkv, D);
        returns (T, Hq, D).
        """


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)
