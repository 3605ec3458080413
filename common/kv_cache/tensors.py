"""The paged KV tensors: one contiguous tensor per layer.

Layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim) — K at [0], V at [1].
Block b of layer l is one contiguous run of bytes in each of K and V, so a transfer of blocks
b..b+n is one descriptor per (layer, K/V).
"""

from __future__ import annotations

import torch

from common.model.hf_config import ArchConfig


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for_memory(
    arch: ArchConfig, block_size: int, dtype: torch.dtype, memory_bytes: int
) -> int:
    num = memory_bytes // bytes_per_block(arch, block_size, dtype)
    if num < 1:
        raise ValueError(
            f"kv_cache_memory={memory_bytes} bytes holds no block "
            f"(one block is {bytes_per_block(arch, block_size, dtype)} bytes)"
        )
    return int(num)


def allocate_kv_caches(
    arch: ArchConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
