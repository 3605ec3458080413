"""Which decode attention runs per batch size class: the C kernel or the torch path it replaces.

The C kernel's AVX-512 code beats the torch paths on every shape measured (docs/benchmarks.md),
so it runs without a measurement. Its AVX2 and plain builds are timed at start-up against the
torch path that would run instead (the compiled kernel where it pays, else SDPA) on the model's
own head shapes, one batch size per class at a context of `CONTEXT` tokens, each call on KV
the calls before it pushed out of the CPU's caches (as in a step), and each class keeps
the faster (common/native/choice.py records every choice for `/health`, the metric and the log).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.attention.metadata import AttentionMetadata
from common.native import choice

KERNEL = "decode_attention"
CONTEXT = 512  # tokens per measured sequence: a few hundred, as in a chat's decode
ROTATION_BYTES = 64 << 20  # synthetic KV the timed calls rotate over: more than a CPU caches


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
    than the torch path, timed on synthetic caches of `kv_cache`'s block and head shape."""
    won = set()
    for cls in BATCH_CLASSES:
        step = synthetic_step(kv_cache, num_heads, cls.measured_at)
        caches = _rotating_caches(kv_cache, step.meta.block_table.numel())
        candidates = {
            native_path: step.runner(native, caches),
            "torch": step.runner(torch_path, caches),
        }
        if choice.choose(KERNEL, cls.label(kv_cache.dtype), candidates) == native_path:
            won.add(cls)
    return frozenset(won)


def record_all(dtype: torch.dtype, path: str, reason: str) -> None:
    """The same path for every class, chosen without a measurement."""
    for cls in BATCH_CLASSES:
        choice.record(KERNEL, cls.label(dtype), path, reason)


@dataclass
class SyntheticStep:
    """B decodes of CONTEXT tokens each in shuffled blocks: a cache of B * blocks-a-sequence
    blocks holds them; q (B, Hq, D) and their own k/v rows (B, Hkv, D)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata

    def runner(self, decode: DecodeFn, caches: list[torch.Tensor]) -> Callable[[], object]:
        """`decode` of this step over the next cache of `caches` at each call."""
        turn = itertools.count()
        scale = self.q.shape[-1] ** -0.5
        return lambda: decode(
            self.q, self.k, self.v, caches[next(turn) % len(caches)], self.meta, scale, None
        )


def synthetic_step(kv_cache: torch.Tensor, num_heads: int, batch: int) -> SyntheticStep:
    _, _, block_size, kv_heads, dim = kv_cache.shape
    per_seq = -(-CONTEXT // block_size)
    gen = torch.Generator().manual_seed(batch)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    meta = AttentionMetadata.for_decodes(table, torch.full((batch,), CONTEXT), block_size)
    q = torch.rand(batch, num_heads, dim, generator=gen).to(kv_cache.dtype)
    k, v = torch.rand(2, batch, kv_heads, dim, generator=gen).to(kv_cache.dtype)
    return SyntheticStep(q, k, v, meta)


def _rotating_caches(kv_cache: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Caches of `num_blocks` blocks shaped as `kv_cache`'s, as many as fill ROTATION_BYTES
    (at least one): the calls take them in turn, so each reads a cache that the calls before it
    pushed out of the CPU's caches, as a layer's KV is when its turn comes in a step."""
    one = (2, num_blocks, *kv_cache.shape[2:])
    count = max(1, ROTATION_BYTES // (math.prod(one) * kv_cache.element_size()))
    # NOTE: written, not zeros: untouched zero pages all map to one page, always in the cache;
    # each its own tensor: a view that starts elsewhere would recompile the torch kernel
    return [torch.full(one, 0.01, dtype=kv_cache.dtype) for _ in range(count)]
