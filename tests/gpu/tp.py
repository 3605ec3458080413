"""The GPU check's `tp` part: a model split over two GPUs (two ranks, NCCL) against one.

- parity: at TP 2 the same greedy tokens as at TP 1, in fp32 (the all-reduces only change the
  order of sums, ~1e-6: that must not flip a token);
- speed: decode tokens/s at TP 1 and TP 2 (bf16 on CUDA, eager), with rank 0's time in each
  kind of collective; figures only.
Skipped under two GPUs. `--device cpu` runs it on the tiny model over gloo, with small batches:
that checks the script, not the GPUs.
"""

from __future__ import annotations

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.gpu import speed


def measure(
    model: str | None,
    device: str,
    prompts,  # vocab size -> token id lists
    max_tokens: int,
    speed_dtype: str,
    batch_sizes: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    num_blocks: int | None = None,  # the KV pool (None: what memory allows)
) -> dict:
    if device == "cuda" and torch.cuda.device_count() < 2:
        return {
            "status": "skipped",
            "reason": f"TP 2 needs 2 GPUs, {torch.cuda.device_count()} here",
        }
    tokens = {}
    for tp in (1, 2):
        llm = LLM(
            model,
            device=device,
            dtype="float32",
            tensor_parallel_size=tp,
            enforce_eager=True,
            enable_prefix_caching=False,
            **({} if num_blocks is None else {"num_blocks": num_blocks}),
        )
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            outs = llm.generate(prompts(llm.engine.arch.vocab_size), params)
            tokens[tp] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()
    mismatches = [i for i, (a, b) in enumerate(zip(tokens[1], tokens[2], strict=True)) if a != b]
    rates = {
        f"tp{tp}": speed.measure(
            device,
            batch_sizes,
            prompt_len,
            new_tokens,
            model,
            enforce_eager=True,
            tensor_parallel_size=tp,
            dtype=speed_dtype,
            num_blocks=num_blocks,
        )
        for tp in (1, 2)
    }
    return {
        "status": "failed" if mismatches else "passed",
        "num_prompts": len(tokens[1]),
        "tokens_each": max_tokens,
        "mismatched_prompts": mismatches,
        "speed": rates,
    }
