"""Which part of the model one tensor-parallel rank holds: pure arithmetic, no communication.

Megatron's split, with N ranks:
- q/k/v and gate/up are column-parallel: rank r holds its KV heads with their groups of query
  heads, and its run of the MLP's intermediate columns;
- o_proj and down_proj are row-parallel: rank r holds the matching input columns, and the
  partial outputs are summed over the ranks (one all-reduce each);
- the embedding and the LM head are vocab-parallel: rank r holds vocabulary rows
  [r·⌈V/N⌉, (r+1)·⌈V/N⌉), the last shard padded with zero rows, so every shard has one shape.
KV heads are split in runs of ⌊r·Hkv/N⌋..⌊(r+1)·Hkv/N⌋, uneven when N does not divide them
(SmolLM2's 3 KV heads over 2 ranks: 1 and 2, with 3 and 6 query heads); when N exceeds them,
each is replicated on N/Hkv ranks (rank r keeps head ⌊r·Hkv/N⌋, the one its query heads read),
which needs N to be a multiple of Hkv and to divide Hq. MLP columns split the same way. Norms
are replicated.

`local_arch(arch)` is one shard's architecture: the decoder built from it has exactly the
shard's shapes, so the model code, the loader's fused views and the KV cache need no other
change. `slice_of(name)` says which rows or columns of a checkpoint tensor the rank reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.arch_config import ArchConfig

_COLUMN_Q = (".q_proj.",)
_COLUMN_KV = (".k_proj.", ".v_proj.")
_COLUMN_MLP = (".gate_proj.", ".up_proj.")
_ROW_Q, _ROW_MLP = (".o_proj.",), (".down_proj.",)
_VOCAB = ("embed_tokens.", "lm_head.")


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} of {self.size}"

    def check(self, arch: ArchConfig) -> None:
        """ValueError naming the dimension that does not split over `size` ranks."""
        n, hq, hkv = self.size, arch.num_heads, arch.num_kv_heads
        if hkv < n and (n % hkv or hq % n):
            raise ValueError(
                f"tensor_parallel_size {n} exceeds the model's {hkv} KV heads, so they are "
                f"replicated: it must then be a multiple of them and divide the {hq} "
                "attention heads"
            )
        if arch.intermediate_size < n:
            raise ValueError(f"tensor_parallel_size {n} exceeds the MLP's columns")

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The architecture of this rank's shard (its vocab size is the padded shard's)."""
        self.check(arch)
        return dataclasses.replace(
            arch,
            num_heads=self.q_heads(arch)[1],
            num_kv_heads=self.kv_heads(arch)[1],
            intermediate_size=self._run(arch.intermediate_size)[1],
            vocab_size=self.vocab_shard_size(arch.vocab_size),
        )

    def _run(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's run when n items split over the ranks."""
        first = self.rank * n // self.size
        return first, (self.rank + 1) * n // self.size - first

    def kv_heads(self, arch: ArchConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds."""
        if arch.num_kv_heads >= self.size:
            return self._run(arch.num_kv_heads)
        return self.rank * arch.num_kv_heads // self.size, 1  # replicated

    def q_heads(self, arch: ArchConfig) -> tuple[int, int]:
        """(first, count) of the query heads this rank holds: its KV heads' groups."""
        if arch.num_kv_heads < self.size:
            return self._run(arch.num_heads)
        group = arch.num_heads // arch.num_kv_heads
        first, count = self.kv_heads(arch)
        return first * group, count * group

    def vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of the vocabulary rows this rank holds (short of the shard size on the
        last rank: the rest are padding)."""
        shard = self.vocab_shard_size(vocab_size)
        start = min(self.rank * shard, vocab_size)
        return start, min(start + shard, vocab_size)

    def slice_of(self, name: str, arch: ArchConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` (without the `model.` prefix) that
        this rank holds; None when it holds all of it."""
        if self.size == 1:
            return None
        if name.startswith(_VOCAB):
            return 0, *self.vocab_range(arch.vocab_size)
        for keys, dim, (first, count), unit in (
            (_COLUMN_Q, 0, self.q_heads(arch), arch.head_dim),
            (_COLUMN_KV, 0, self.kv_heads(arch), arch.head_dim),
            (_ROW_Q, 1, self.q_heads(arch), arch.head_dim),
            (_COLUMN_MLP, 0, self._run(arch.intermediate_size), 1),
            (_ROW_MLP, 1, self._run(arch.intermediate_size), 1),
        ):
            if any(key in name for key in keys):
                return dim, first * unit, (first + count) * unit
        return None


def kv_heads_held(arch: ArchConfig, size: int) -> int:
    """KV heads all `size` ranks hold together: the model's, or more when replicated."""
    TPShard(0, size).check(arch)
    return sum(TPShard(rank, size).kv_heads(arch)[1] for rank in range(size))
