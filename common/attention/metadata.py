"""Per-step attention metadata, built once by the model runner and read by every layer.

Sequences are laid out decodes first (one query token each), then prefill chunks.
`seq_lens` counts each sequence's tokens in the cache after this step (cached prefix + new).
In a decode replayed as a captured graph (common/engine/decode_graphs.py) the lengths exist
only on the device, in `seq_lens_tensor`: `seq_lens` then holds the capture's bound for every
sequence, and a backend must read no context past its `seq_lens_tensor` length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block_id * block_size + offset)
    query_start_loc: list[int]  # (S + 1,) token offsets of each sequence's queries
    seq_lens: list[int]  # (S,) context length per sequence after this step
    block_table: torch.Tensor  # (S, max_blocks) int64, padded with 0
    seq_lens_tensor: torch.Tensor  # (S,) int64
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    request_ids: list[str]  # (S,) for connectors: whose KV each row is
    memo: dict = field(default_factory=dict)  # per-step values a backend derives once
    # query_start_loc on the device, int32; set where no host copy may run (a graph capture)
    query_start_loc_tensor: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @classmethod
    def for_decodes(
        cls, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> AttentionMetadata:
        """A step of decodes only: one query each, the new token at the last of `seq_lens`
        (B,) positions of its row of `block_table` (B, max_blocks). For timing and tests."""
        batch, last = len(seq_lens), seq_lens - 1
        blocks = block_table.gather(1, (last // block_size)[:, None])[:, 0]
        return cls(
            slot_mapping=blocks * block_size + last % block_size,
            query_start_loc=list(range(batch + 1)),
            seq_lens=seq_lens.tolist(),
            block_table=block_table,
            seq_lens_tensor=seq_lens,
            num_decodes=batch,
            block_size=block_size,
            request_ids=[str(i) for i in range(batch)],
        )
