"""The engine against transformers on tiny random models of every supported architecture:
greedy tokens identical and logits within 1e-5, 32+ new tokens, prompts longer than a block."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.tiny_models import ARCHS, VOCAB

NEW_TOKENS = 36
PROMPT_LENS = (21, 53)  # one and three-plus blocks of 16; 53 + 36 > the Mistral window of 24


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _hf_greedy(model_dir, prompt):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


def _ours_greedy(llm: LLM, prompt):
    model = llm.engine.model
    recorded = []
    compute = model.compute_logits
    model.compute_logits = lambda h: recorded.append(compute(h)) or recorded[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate(prompt, params)[0].outputs[0]
    finally:
        del model.compute_logits
    return out.token_ids, torch.cat(recorded)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers(tiny_model, arch):
    model_dir = tiny_model(arch)
    llm = LLM(str(model_dir), num_blocks=64, block_size=16)
    for i, n in enumerate(PROMPT_LENS):
        prompt = _prompt(n, seed=i)
        hf_tokens, hf_logits = _hf_greedy(model_dir, prompt)
        tokens, logits = _ours_greedy(llm, prompt)
        assert tokens == hf_tokens, f"{arch}: greedy tokens differ for a {n}-token prompt"
        assert len(set(tokens)) > NEW_TOKENS // 3, "degenerate model: the comparison proves little"
        diff = (logits - hf_logits).abs().max().item()
        assert diff < 1e-5, f"{arch}: max |logit diff| {diff:.2e} for a {n}-token prompt"
    assert llm.engine.pool.num_used_blocks == 0
