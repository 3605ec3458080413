"""Decode tokens/s of the default model (SmolLM2-135M) through `LLM`, compiled (the default:
with decode CUDA graphs on CUDA), compiled without graphs (`cuda_graph_sizes=()`) or eager, no
threshold. With `with_sample`, also its greedy tokens for a few fixed prompts (`sample`), so that
the modes' answers can be compared; and how many decode steps replayed a graph.

Per batch size: `batch` random prompts of `prompt_len` tokens, greedy, EOS ignored, timed once
with max_tokens=1 (prefill + first token) and once with `new_tokens`; decode tokens/s is
batch * (new_tokens - 1) / (difference of the two). Prefix caching is off so that the second
run recomputes its prompts as the first did.
"""

from __future__ import annotations

import time

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def measure(
    device: str,
    batch_sizes=(1, 32),
    prompt_len: int = 128,
    new_tokens: int = 128,
    model: str | None = None,  # None: the default model
    enforce_eager: bool = False,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    cuda_graph_sizes: tuple[int, ...] | None = None,  # None: the engine's default
    with_sample: bool = False,
    num_blocks: int | None = None,  # the KV pool (None: what memory allows)
) -> dict:
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
        cuda_graph_sizes=cuda_graph_sizes,
        **({} if num_blocks is None else {"num_blocks": num_blocks}),
    )
    try:
        result = _measure(llm, batch_sizes, prompt_len, new_tokens, enforce_eager)
        if with_sample:
            result["sample"] = sample(llm, llm.engine.arch.vocab_size)
        return result
    finally:
        llm.shutdown()  # its tensor-parallel ranks too


def _measure(llm: LLM, batch_sizes, prompt_len: int, new_tokens: int, enforce_eager: bool):
    vocab = llm.engine.arch.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [
            torch.randint(20, vocab - 20, (prompt_len,), generator=g).tolist() for _ in range(n)
        ]

    timed(llm, prompts(4), 16)  # warm-up: kernels, allocator
    rows = []
    for batch in batch_sizes:
        first = timed(llm, prompts(batch), 1)
        total = timed(llm, prompts(batch), new_tokens)
        rows.append(
            {
                "batch": batch,
                "prompt_tokens": prompt_len,
                "new_tokens": new_tokens,
                "decode_tok_s": round(batch * (new_tokens - 1) / (total - first), 1),
                "end_to_end_tok_s": round(batch * new_tokens / total, 1),
                "seconds": round(total, 3),
            }
        )
    backend = next(iter(llm.engine.model.attention_layers().values())).backend.name
    mode = "eager" if enforce_eager else "compiled"
    runner = llm.engine.runner
    graphs = runner.graphs
    result = {
        "status": "measured",
        "mode": mode,
        "compile_s": round(runner.compile_seconds, 1),
        "backend": backend,
        "graph_sizes": list(graphs.sizes) if graphs else [],
        "capture_s": round(runner.capture_seconds, 1),
        "capture_mib": round(graphs.capture_bytes / 2**20) if graphs else 0,
        "graph_steps": graphs.num_steps if graphs else 0,
        "rows": rows,
    }
    if llm.engine.tp is not None:  # rank 0's time in each kind of collective, over the runs
        stats = llm.engine.tp.stats
        result["collectives"] = {
            kind: {"calls": stats.calls[kind], "seconds": round(stats.seconds[kind], 3)}
            for kind in stats.calls
        }
    return result


def sample(llm: LLM, vocab: int, num_prompts: int = 6, new_tokens: int = 32) -> list[list[int]]:
    """Greedy tokens of fixed prompts (17-120 tokens), run together: decode batches of 6 down."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(17, 120, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(20, vocab - 20, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "short output"
    return seconds
