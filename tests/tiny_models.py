"""Tiny random HF models of every supported architecture, built offline with transformers.

A known trap: random tied embeddings at the default initializer range emit one token over
and over, so these use a large initializer range and untied heads (except where the tie itself
is under test), which gives varied greedy tokens with clear top-1/top-2 gaps; the output
embedding is then scaled so logits are of order 1.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from tests.tiny_tokenizer import write_tiny_tokenizer

VOCAB = 1024

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral-swa": ("MistralConfig", dict(sliding_window=24, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1e6)),
}


def build_tiny_model(name: str, out_dir: Path) -> Path:
    import transformers

    config_cls, extra = ARCHS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra})
    torch.manual_seed(zlib.crc32(name.encode()))
    model_cls = getattr(transformers, config.architectures[0]) if config.architectures else None
    if model_cls is None:
        model_cls = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))
    model = model_cls(config).to(torch.float32)
    if name.startswith("qwen2"):  # non-zero biases so the bias path is really exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.3)
    with torch.no_grad():  # logits of order 1, as a trained model's: 1e-5 is then fp32 noise
        model.get_output_embeddings().weight.mul_(0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tiny_tokenizer(out_dir, VOCAB)
    return out_dir
