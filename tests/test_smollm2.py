"""The built-in default model: SmolLM2-135M-Instruct against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU does.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256, max_model_len=2048)


@pytest.fixture(scope="module")
def hf(llm):
    import transformers

    folder = llm.engine.config.model.model_dir
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=24)
    )[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_greedy_tokens_and_logits_match_transformers(llm, hf):
    tok = llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    recorded = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: recorded.append(compute(h)) or recorded[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        ours = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    finally:
        del llm.engine.model.compute_logits
    logits = torch.cat(recorded).view(len(prompts), NEW_TOKENS, -1)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            # the prompt holds <|im_end|> (the pad id): give the mask, or transformers infers one
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=2,
            )
        assert ours[i] == ref.sequences[0, len(prompt) :].tolist(), QUESTIONS[i]
        diff = (logits[i] - torch.cat(ref.logits)).abs().max().item()
        assert diff < 1e-4, f"{QUESTIONS[i]!r}: max |logit diff| {diff:.2e}"
    assert llm.engine.pool.num_used_blocks == 0
