"""`ArchConfig`: the one description of a model's architecture that the engine reads (layers,
heads, sizes, RoPE, special tokens). It sits beside the config, not in the model package: the KV
cache sizes its blocks by it and the tensor-parallel ranks split heads by it, below the model
that builds layers from it. common/model/hf_config.py parses one from an HF `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (`rope_type: llama3`); absent for plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
