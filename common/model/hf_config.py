"""Parse an HF `config.json` into the one architecture description the decoder needs
(`ArchConfig`, common/arch_config.py).

Supported: LlamaForCausalLM (incl. Llama 3 rope scaling), MistralForCausalLM (sliding window),
Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k RMSNorm, explicit head_dim).
Both rope spellings are read: `rope_theta` + `rope_scaling` (hub configs) and `rope_parameters`
(transformers 5.x).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.arch_config import ArchConfig, RopeScaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the problem."""


def load_arch_config(model_dir: str | Path) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a model folder needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    return parse_arch_config(raw, source=str(path))


def parse_arch_config(raw: dict, source: str = "config.json") -> ArchConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        theta, scaling = _parse_rope(raw)
        sliding = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
        if arch.startswith("Qwen2") and not raw.get("use_sliding_window", False):
            sliding = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ArchConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e


def _parse_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    # transformers 5.x folds theta and the scaling into rope_parameters
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"config.json: unsupported rope_type {rope_type!r} (default, llama3)")
    return theta, RopeScaling(
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )
