"""The SmolLM2 folder prepared from the GGUF matches what transformers reads from the same GGUF.

The folder is prepared once into the real cache (later tests and servers reuse it); transformers'
own GGUF path (AutoTokenizer / load_gguf_checkpoint) is the oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.model.default_model import (
    GGUF_NAME,
    MARKER,
    _hf_name,
    _unpermute_rows,
    default_model_dir,
    gguf_path,
)
from common.model.hf_config import ModelLoadError, load_arch_config
from common.settings import CACHE_ENV
from common.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "12345 and 3.14159 and 1,000,000",
    "emoji 😀👍🏽👨‍👩‍👧 🇫🇷",
    "日本語のテキスト, 中文文本, 한국어",
    "multiple   spaces\t\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count: 1 2 3 😀"},
    ],
]


def prepared_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real cache, so later tests and runs reuse it; a session temp dir if it is unusable."""
    try:
        return default_model_dir()
    except OSError:
        os.environ[CACHE_ENV] = str(tmp_path_factory.getbasetemp() / "pdserve-cache")
        return default_model_dir()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_folder_has_files(model_dir: Path):
    assert model_dir.name == "SmolLM2-135M-Instruct"
    for name in (*FILES, MARKER):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(".SmolLM2-135M-Instruct.tmp-*"))
    assert default_model_dir() == model_dir  # fast path


@pytest.mark.slow
def test_config_values(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected
    arch = load_arch_config(model_dir)
    assert (arch.num_layers, arch.eos_token_ids, arch.rope_scaling) == (30, (2,), None)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow
def test_tokenizer_matches_transformers(ours: Tokenizer, hf_tokenizer):
    assert ours.vocab_size == 49152
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM2 splits single digits


@pytest.mark.slow
def test_chat_template_matches_transformers(ours: Tokenizer, hf_tokenizer):
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(messages) == expected


@pytest.mark.slow
def test_tensors_match_transformers(model_dir: Path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # NOTE: AutoModelForCausalLM.from_pretrained(gguf_file=...) insists on `accelerate`, which we
    # do not install; load_gguf_checkpoint is the dequantize + rename + un-permute step it runs.
    path = gguf_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    expected = loaded["tensors"]
    actual = load_file(model_dir / "model.safetensors")
    assert set(actual) == set(expected)
    assert "lm_head.weight" not in actual
    assert actual["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    for name in sorted(actual):  # every tensor, incl. layer 0 q/k/v/o and the embeddings
        assert actual[name].dtype == torch.float32, name
        torch.testing.assert_close(actual[name], expected[name].float(), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_greedy_chat_answers_paris(model_dir: Path, ours: Tokenizer):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ours.apply_chat_template(question)
    input_ids = torch.tensor([ours.encode(prompt, add_special_tokens=False)])
    out = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in ours.decode(out[0, input_ids.shape[1] :].tolist())


@pytest.mark.slow
def test_concurrent_prepare_is_atomic(tmp_path: Path):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "common.model.default_model"]
    procs = [
        subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tmp_path / "SmolLM2-135M-Instruct")] * 2
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "SmolLM2-135M-Instruct"
    ]
    assert all((tmp_path / "SmolLM2-135M-Instruct" / name).is_file() for name in FILES)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((3 * 64, 16)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf permute for 3 heads of head_dim 64
    gguf = hf.reshape(3, 2, 32, 16).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(_unpermute_rows(gguf, 3), hf)


def test_unexpected_tensor_names_the_file():
    name = _hf_name("blk.7.ffn_down.weight", Path(GGUF_NAME))
    assert name == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(ModelLoadError, match=r"x\.gguf.*'blk\.0\.attn_qkv\.weight'"):
        _hf_name("blk.0.attn_qkv.weight", Path("x.gguf"))
