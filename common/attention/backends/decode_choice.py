"""Which decode attention runs per batch size class: the C kernel or the torch path it replaces.

The C kernel's AVX-512 code beats the torch paths on every shape measured (docs/benchmarks.md),
so it runs without a measurement. Its AVX2 and plain builds are timed at start-up against the
torch path that would run instead (the compiled kernel where it pays, else SDPA) on the model's
own head shapes, one batch size per class at a context of `CONTEXT` tokens, and each class keeps
the faster (common/native/choice.py records every choice for `/health`, the metric and the log).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from common.attention.metadata import AttentionMetadata
from common.native import choice

KERNEL = "decode_attention"
CONTEXT = 256  # tokens per measured sequence: a few hundred, as in a chat's decode


@dataclass(frozen=True)
class BatchClass:
    first: int
    last: int | None  # None: no upper bound
    measured_at: int  # the batch size timed for the class

    def holds(self, num_decodes: int) -> bool:
        return self.first <= num_decodes and (self.last is None or num_decodes <= self.last)

    def label(self, dtype: torch.dtype) -> str:
        sizes = f"{self.first}+" if self.last is None else f"{self.first}-{self.last}"
        return f"{str(dtype).removeprefix('torch.')} batch {sizes}"


BATCH_CLASSES = (BatchClass(1, 4, 1), BatchClass(5, 16, 8), BatchClass(17, None, 32))


def batch_class(num_decodes: int) -> BatchClass:
    return next(c for c in BATCH_CLASSES if c.holds(num_decodes))


# decode(q, k, v, kv_cache, meta, scale, sliding_window): a step's decodes only, q (B, Hq, D),
# their own K/V rows k, v (B, Hkv, D) written to the cache at meta.slot_mapping
DecodeFn = Callable[..., torch.Tensor]


def choose_native_classes(
    native_path: str, native: DecodeFn, torch_path: DecodeFn, kv_cache: torch.Tensor, num_heads: int
) -> frozenset[BatchClass]:
    """The batch classes where the C kernel (`native_path`: "c-avx2", "c-plain") ran faster
    than the torch path, timed on a synthetic cache of `kv_cache`'s block and head shape."""
    won = set()
    step = _synthetic_step(kv_cache, num_heads, max(c.measured_at for c in BATCH_CLASSES))
    for cls in BATCH_CLASSES:
        args = _first(step, cls.measured_at)
        candidates = {native_path: partial(native, *args), "torch": partial(torch_path, *args)}
        if choice.choose(KERNEL, cls.label(kv_cache.dtype), candidates) == native_path:
            won.add(cls)
    return frozenset(won)


def record_all(dtype: torch.dtype, path: str, reason: str) -> None:
    """The same path for every class, chosen without a measurement."""
    for cls in BATCH_CLASSES:
        choice.record(KERNEL, cls.label(dtype), path, reason)


def _synthetic_step(kv_cache: torch.Tensor, num_heads: int, batch: int):
    """q (B, Hq, D), this step's k/v rows (B, Hkv, D), a cache shaped as `kv_cache` holding B
    contexts of CONTEXT tokens in shuffled blocks, and their metadata."""
    _, _, block_size, kv_heads, dim = kv_cache.shape
    per_seq = -(-CONTEXT // block_size)
    gen = torch.Generator().manual_seed(0)
    cache = torch.rand(2, batch * per_seq, block_size, kv_heads, dim, generator=gen)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    last = CONTEXT - 1
    lens = torch.full((batch,), CONTEXT)
    meta = AttentionMetadata(
        slot_mapping=table[:, last // block_size] * block_size + last % block_size,
        query_start_loc=list(range(batch + 1)),
        seq_lens=lens.tolist(),
        block_table=table,
        seq_lens_tensor=lens,
        num_decodes=batch,
        block_size=block_size,
        request_ids=[str(i) for i in range(batch)],
    )
    dtype = kv_cache.dtype
    q = torch.rand(batch, num_heads, dim, generator=gen).to(dtype)
    k, v = torch.rand(2, batch, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, cache.to(dtype), meta


def _first(step, batch: int):
    """The first `batch` sequences of a synthetic step, as DecodeFn's arguments."""
    q, k, v, cache, meta = step
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:batch],
        query_start_loc=meta.query_start_loc[: batch + 1],
        seq_lens=meta.seq_lens[:batch],
        block_table=meta.block_table[:batch],
        seq_lens_tensor=meta.seq_lens_tensor[:batch],
        num_decodes=batch,
        block_size=meta.block_size,
        request_ids=meta.request_ids[:batch],
    )
    return q[:batch], k[:batch], v[:batch], cache, sub, q.shape[-1] ** -0.5, None
