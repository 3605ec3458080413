"""Model folders: config parsing (both rope spellings), sharded weights, and errors that name the
file and the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from common.model.hf_config import ModelLoadError, load_arch_config, parse_arch_config
from common.model.loader import load_model

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
)
LLAMA3 = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_both_rope_spellings_parse_alike():
    hub = parse_arch_config(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    )
    new = parse_arch_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}
    )
    assert hub == new and hub.rope_theta == 5e5 and hub.rope_scaling.factor == 8.0
    plain = parse_arch_config(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_architecture_specifics():
    qwen3 = parse_arch_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.qkv_bias
    qwen2 = parse_arch_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8})
    assert qwen2.qkv_bias and qwen2.sliding_window is None  # use_sliding_window is off
    mistral = parse_arch_config(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8}
    )
    assert mistral.sliding_window == 8


def test_unsupported_architecture_names_file(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**BASE, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture.*GPT2"):
        load_arch_config(tmp_path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config.json: missing"):
        load_arch_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(tmp_path, torch.float32, "cpu", 64)
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in BASE.items() if k != "hidden_size"})
    )
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        load_arch_config(tmp_path)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_shape_mismatch_and_missing_weight(tiny_model, tmp_path):
    folder = _copy(tiny_model("llama"), tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = dict(weights, **{name: torch.zeros(3, 3)})
    save_file(bad, folder / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=rf"model.safetensors: tensor '{name}' has shape \(3, 3\)"
    ):
        load_model(folder, torch.float32, "cpu", 64)
    save_file({k: v for k, v in weights.items() if k != name}, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"weights missing.*layers.1.self_attn.qkv_proj"):
        load_model(folder, torch.float32, "cpu", 64)


def test_sharded_weights_load_the_same(tiny_model, tmp_path):
    import transformers

    src = tiny_model("qwen2")
    folder = _copy(src, tmp_path / "sharded")
    (folder / "model.safetensors").unlink()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(10, 40))
    one = LLM(str(src), num_blocks=32).generate(prompt, params)[0].outputs[0].token_ids
    many = LLM(str(folder), num_blocks=32).generate(prompt, params)[0].outputs[0].token_ids
    assert one == many
