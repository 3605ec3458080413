"""A prefill worker's step size: prompts that arrive together, prefilled under several token
budgets (`--max-num-batched-tokens`), on one core and one thread as the local cluster's P runs.

Each round adds N prompts of random token ids at once (max_tokens=1, as the proxy's prefill
asks) to one engine per budget, in turn, and steps until all are done. Per budget: prefill
throughput (prompt tokens / s), steps, and each prompt's completion time from the moment all
were added (its TTFT on a prefill worker, queueing included): mean, p50, max; the last columns
compare throughput and mean TTFT with the largest budget of the same round.

On a CPU prefill is compute-bound from ~128 tokens a step on, so throughput stays level while a
smaller budget lets the prompts finish one after another instead of all together at the end
of one long step (docs/benchmarks.md, "A prefill worker's step").

    python benchmarks/prefill_budget.py [--budgets 128 256 512 2048] [--prompts 12]
                                        [--prompt-len 180] [--rounds 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def run_round(llm: LLM, prompts: list[list[int]], tag: str) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    done, steps = [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        done += [time.perf_counter() - start for out in outputs if out.finished]
    total = time.perf_counter() - start
    assert len(done) == len(prompts) and engine.pool.num_used_blocks == 0
    return {
        "tok/s": sum(map(len, prompts)) / total,
        "steps": steps,
        "mean": 1e3 * statistics.mean(done),
        "p50": 1e3 * statistics.median(done),
        "max": 1e3 * max(done),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 2048])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=180)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--core", type=int, default=min(os.sched_getaffinity(0)))
    a = p.parse_args()
    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    llms = {
        b: LLM(dtype=a.dtype, max_num_batched_tokens=b, enable_prefix_caching=False)
        for b in a.budgets
    }
    rng = random.Random(0)
    vocab = llms[a.budgets[0]].engine.arch.vocab_size
    print(f"{a.prompts} prompts of {a.prompt_len} tokens at once, 1 thread on core {a.core}")
    print("| round | budget | tok/s | steps | TTFT mean ms | p50 ms | max ms | tok/s ÷ largest "
          "| TTFT mean ÷ largest |")  # fmt: skip
    print("|---:" * 9 + "|")
    largest = max(a.budgets)
    for rnd in range(1, a.rounds + 1):
        results = {}
        for b, llm in llms.items():  # fresh prompts each time: no prefix cache, no warm rows
            prompts = [
                [rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)
            ]
            results[b] = run_round(llm, prompts, f"r{rnd}-{b}")
        ref = results[largest]
        for b, r in results.items():
            print(
                f"| {rnd} | {b} | {r['tok/s']:.0f} | {r['steps']} | {r['mean']:.0f} | "
                f"{r['p50']:.0f} | {r['max']:.0f} | {r['tok/s'] / ref['tok/s']:.2f} | "
                f"{r['mean'] / ref['mean']:.2f} |"
            )


if __name__ == "__main__":
    main()
