"""Optional KV integrity check (`--kv-checksum`): P sums the raw bits of every block of a
request, per layer, when it hands the KV over; D sums what it received, per layer, before the
request decodes. A mismatch — blocks reused after an expired lease, a torn or misdirected
transfer — fails the load closed: the engine recomputes the prompt or fails the request.

The sum is over the blocks' bytes read as integers (int32 words for 4-byte dtypes, int16 for
2-byte ones), modulo 2**32: one memory pass, no hashing, enough to catch stale or foreign blocks
(not an adversary, who can write KV memory anyway; see docs/security.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK = (1 << 32) - 1
_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.int8}


LayerKV = torch.Tensor | Sequence[torch.Tensor]  # one layer's cache, or its heads' shards


def block_checksums(kv_cache: LayerKV, block_ids: list[int]) -> list[int]:
    """One layer's cache (2, num_blocks, block_size, kv_heads, head_dim): a checksum per block.
    A tensor-parallel worker's layer is its shards, which hold each head once between them: the
    sum of theirs is the sum over every head, whatever the TP size on either side."""
    if not block_ids:
        return []
    total = torch.zeros(len(block_ids), dtype=torch.int64)
    for shard in [kv_cache] if isinstance(kv_cache, torch.Tensor) else kv_cache:
        index = torch.tensor(block_ids, device=shard.device)
        blocks = shard.index_select(1, index)  # (2, n, bs, H, D)
        words = blocks.view(_INT_VIEW[shard.element_size()]).view(2, len(block_ids), -1)
        total += words.sum(dim=2, dtype=torch.int64).sum(dim=0).cpu()  # (n,)
    return [int(s) & _MASK for s in total.tolist()]


def request_checksums(kv_caches: Sequence[LayerKV], block_ids: list[int]) -> list[list[int]]:
    """P: per layer, per block."""
    return [block_checksums(layer, block_ids) for layer in kv_caches]


def mismatch(
    kv_cache: LayerKV, block_ids: list[int], expected: list[int], layer: int
) -> str | None:
    """D: why this layer's received blocks differ from P's checksums, or None."""
    got = block_checksums(kv_cache, block_ids)
    if got == expected:
        return None
    bad = (
        next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        if len(got) == len(expected)
        else -1
    )
    return f"KV checksum mismatch in layer {layer} (block #{bad} of {len(block_ids)})"
