"""`python -m common.engine "question" [...]`: ask the model offline (no server), print answers.

Prompts go through the model's chat template unless `--raw`.
"""

from __future__ import annotations

import argparse
import time

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m common.engine", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="one or more questions")
    parser.add_argument(
        "--model",
        default=None,
        help="HF-format model folder (default: the built-in SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model, device=args.device)
    loaded = time.perf_counter()
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    if args.raw:
        outputs = llm.generate(args.prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    done = time.perf_counter()
    for prompt, out in zip(args.prompts, outputs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[loaded in {loaded - start:.1f} s; {num_tokens} tokens in {done - loaded:.1f} s]")


if __name__ == "__main__":
    main()
