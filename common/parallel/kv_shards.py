"""Every rank's KV cache where rank 0 can reach it: what a tensor-parallel worker needs to move
KV over NIXL with one agent (docs/design.md, "KV between TP sizes").

Rank 0 creates each other rank's shard of the paged KV cache as an anonymous shared file
(memfd), maps it, and hands the file to the rank at start (inherited descriptor), which maps the
same pages as its KV cache. Rank 0's connector then registers all shards with its one NIXL
agent, and its transfers read and write every rank's heads; nothing about KV transfer runs in
the other ranks. The files have no name: they go with the last process that maps them.

CPU only: a CUDA rank's KV lives in its own GPU's memory, which rank 0's agent cannot register
(config.py refuses a KV connector for a CUDA worker at TP > 1).
"""

from __future__ import annotations

import mmap
import os

import torch

from common.arch_config import ArchConfig
from common.kv_transfer.layout import ShardTensors
from common.parallel.shard import TPShard


def shard_shape(local_arch: ArchConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """(num_layers, 2, num_blocks, block_size, the rank's KV heads, head_dim)."""
    a = local_arch
    return (a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim)


def map_shard(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """The per-layer KV tensors in the shared file `fd` (its size set by the creator)."""
    num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
    return list(torch.frombuffer(buf, dtype=dtype).view(shape).unbind(0))


class SharedKVShards:
    """Ranks 1..size-1's KV shards, created and mapped by rank 0."""

    def __init__(
        self, arch: ArchConfig, size: int, num_blocks: int, block_size: int, dtype: torch.dtype
    ):
        self.fds: dict[int, int] = {}
        self.shards: list[ShardTensors] = []
        elem = torch.empty((), dtype=dtype).element_size()
        for rank in range(1, size):
            shard = TPShard(rank, size)
            shape = shard_shape(shard.local_arch(arch), num_blocks, block_size)
            fd = os.memfd_create(f"pdserve-kv-rank{rank}", os.MFD_CLOEXEC)
            os.ftruncate(fd, torch.Size(shape).numel() * elem)  # zero-filled
            self.fds[rank] = fd
            first_head = shard.kv_heads(arch)[0]
            self.shards.append(ShardTensors(first_head, map_shard(fd, shape, dtype)))

    def close_files(self) -> None:
        """Once every rank has mapped its shard: the mappings keep the pages."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
