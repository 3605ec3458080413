"""The vocab-parallel embedding of a tensor-parallel rank (common/parallel/shard.py).

Each rank holds vocabulary rows [start, stop), padded with zero rows to the shard size. A token
outside them embeds to zero here, so the all-reduce (a sum) gives every rank the one row that
its owner looked up: exact, since adding zeros rounds nothing. The same rows, tied or not, make
the rank's LM head shard, whose logits rank 0 gathers (`LlamaForCausalLM.compute_logits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel.group import TPGroup, all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.start, self.stop = tp.shard.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(tp.shard.vocab_shard_size(vocab_size), hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) → (T, hidden), the same on every rank."""
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        h = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0)
        return all_reduce(h, self.tp)
