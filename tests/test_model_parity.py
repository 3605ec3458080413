"""The engine against transformers on tiny random models of every supported architecture:
greedy tokens identical and logits within 1e-5, 32+ new tokens, prompts longer than a block."""

from __future__ import annotations

import pytest
import torch
import transformers

from common.engine.llm import LLM
from tests.oracle import engine_greedy, hf_greedy
from tests.tiny_models import ARCHS, VOCAB

NEW_TOKENS = 36
PROMPT_LENS = (21, 53)  # one and three-plus blocks of 16; 53 + 36 > the Mistral window of 24
# the compiled path on a subset: each compile costs ~10-20 s on 2 cores. qwen2 after llama in
# one process checks that a model with q/k/v biases does not run the first model's graph
COMPILED = ("llama", "qwen2", "qwen3")
CASES = [(arch, True) for arch in sorted(ARCHS)] + [(arch, False) for arch in COMPILED]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize(
    "arch, enforce_eager", CASES, ids=[f"{a}-{'eager' if e else 'compiled'}" for a, e in CASES]
)
def test_greedy_matches_transformers(tiny_model, arch, enforce_eager):
    model_dir = tiny_model(arch)
    llm = LLM(
        str(model_dir), num_blocks=64, block_size=16, dtype="float32", enforce_eager=enforce_eager
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, n in enumerate(PROMPT_LENS):
        prompt = _prompt(n, seed=i)
        hf_tokens, hf_logits = hf_greedy(hf, prompt, NEW_TOKENS, pad_id=0)
        tokens, logits = engine_greedy(llm, prompt, NEW_TOKENS)
        assert tokens == hf_tokens, f"{arch}: greedy tokens differ for a {n}-token prompt"
        assert len(set(tokens)) > NEW_TOKENS // 3, "degenerate model: the comparison proves little"
        diff = (logits - hf_logits).abs().max().item()
        assert diff < 1e-5, f"{arch}: max |logit diff| {diff:.2e} for a {n}-token prompt"
    assert llm.engine.pool.num_used_blocks == 0
