"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Inputs are flattened across sequences: input_ids (T,), positions (T,). Attention goes through
`common.attention.Attention`, which reads the paged KV cache and the step's metadata from the
forward context. q/k/v and gate/up projections are fused at load time.

With a tensor-parallel group (`tp`, common/parallel/) the model is one rank's shard: it is built
from the shard's architecture (`TPShard.local_arch`: its heads, its MLP columns, its vocabulary
rows), o_proj's and down_proj's partial outputs are summed over the ranks (one all-reduce
each), the embedding is vocab-parallel, and the LM head's vocabulary shards are gathered on
rank 0. Without one (TP = 1) none of that code runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.arch_config import ArchConfig
from common.attention.layer import Attention
from common.model.layers import RMSNorm, RotaryEmbedding
from common.model.vocab_parallel import VocabParallelEmbedding
from common.parallel.group import TPGroup, all_reduce


class SelfAttention(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup | None = None
    ):
        super().__init__()
        self.tp = tp
        self.q_size, self.kv_size, self.head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.attn = Attention(
            f"model.layers.{layer_idx}.self_attn.attn",
            layer_idx,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.sliding_window,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)  # (T, Hq, D)
        k = k.view(num_tokens, -1, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.contiguous())
        out = self.o_proj(out)
        return out if self.tp is None else all_reduce(out, self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if torch.compiler.is_compiling():
            # NOTE: out of place: an in-place SiLU on half of a buffer makes inductor rewrite
            # the whole buffer under a mask (8 ms a layer at 2048 bf16 tokens instead of ~1)
            out = self.down_proj(F.silu(gate) * up)
        else:
            out = self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return out if self.tp is None else all_reduce(out, self.tp)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup | None = None
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx, rope, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        cfg = arch if tp is None else tp.shard.local_arch(arch)
        self.config = cfg  # this rank's shard
        self.vocab_size = arch.vocab_size
        self.tp = tp
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling)
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if tp is None
            else VocabParallelEmbedding(arch.vocab_size, cfg.hidden_size, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.packed_head: nn.Module | None = None  # set by the compiled path on CPU

    def attention_layers(self) -> dict[str, Attention]:
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in self.layers}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) → final hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (N, hidden) → logits (N, vocab) in float32; with `tp`, on rank 0 (None on the
        others: only rank 0 samples)."""
        if self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        else:
            logits = F.linear(hidden, self.head_weight).float()
        if self.tp is None:
            return logits
        logits = self.tp.gather_vocab(logits)  # (N, padded vocab) on rank 0
        return None if logits is None else logits[:, : self.vocab_size]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
