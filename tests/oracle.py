"""Greedy generation with its raw logits, from transformers (the oracle) and from this engine."""

from __future__ import annotations

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def hf_greedy(hf_model, prompt: list[int], new_tokens: int, pad_id: int):
    """(tokens, logits (new_tokens, V)) of transformers' greedy `generate`, batch 1."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # an explicit mask: a prompt may hold the pad id, and transformers would infer padding
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


def engine_greedy(llm: LLM, prompt: list[int], new_tokens: int):
    """(tokens, logits (new_tokens, V)) of this engine's greedy run, recorded at the LM head."""
    model = llm.engine.model
    recorded: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda h: recorded.append(compute(h)) or recorded[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        out = llm.generate(prompt, params)[0].outputs[0]
    finally:
        del model.compute_logits
    return out.token_ids, torch.cat(recorded)
