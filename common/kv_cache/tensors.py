"""The paged KV tensors: one contiguous tensor per layer.

Layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim) — K at [0], V at [1].
Block b of layer l is one contiguous run of bytes in each of K and V, so a transfer of blocks
b..b+n is one descriptor per (layer, K/V).

On CPU the tensors live in transparent huge pages (2 MiB, `madvise`): UCX's cma transport
(process_vm_readv/writev) pins and walks the source and target pages on every transfer, and
moves the same KV about 2x as fast when they are huge pages (benchmarks/studies/bench_transfer.py
compares both in one run). Where the kernel gives none, they are plain pages. The layers are
views of one mapping, so NIXL registers them as one region (kv_transfer/nixl/transport.py).
"""

from __future__ import annotations

import mmap

import torch

from common.arch_config import ArchConfig

_HUGE_PAGE = 2 << 20


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
    huge_pages: bool = True,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    if torch.device(device).type == "cpu" and huge_pages:  # one mapping: one NIXL registration
        return list(huge_page_zeros((arch.num_layers, *shape), dtype).unbind(0))
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own private anonymous mapping, advised into transparent huge
    pages and touched now (no page faults under the first transfers). The tensor keeps the
    mapping alive; it is unmapped with the last reference."""
    num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, num_bytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HUGE_PAGE  # start on a huge-page boundary
    tensor = raw[skip : skip + num_bytes].view(dtype).view(shape)
    return tensor.zero_()
