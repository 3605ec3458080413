"""The vLLM side of bench_engine.py: runs in vLLM's own virtualenv, never imports pdserve.

Reads the prompts (token ids) from a JSON file, generates greedily with EOS ignored for each batch
size with offline `LLM.generate`, and prints one JSON line: {"tok_s": {batch: output tok/s}}.

    <vllm venv>/bin/python benchmarks/vllm_peer.py MODEL_DIR PROMPTS_JSON --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts", help="a JSON list of token-id lists")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    with open(a.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_num_seqs=max(a.concurrency),
        max_model_len=len(prompts[0]) + a.new_tokens + 16,
        enable_prefix_caching=False,  # like bench_engine, which resets its prefix cache
        seed=0,
    )
    params = SamplingParams(max_tokens=a.new_tokens, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2))  # warm-up
    tok_s = {}
    for c in a.concurrency:
        batch = [{"prompt_token_ids": p} for p in prompts[:c]]
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == a.new_tokens for o in outs)
        tok_s[c] = c * a.new_tokens / elapsed
    print("VLLM_RESULT " + json.dumps({"tok_s": tok_s}), flush=True)


if __name__ == "__main__":  # vLLM's engine core spawns: the guard keeps children from re-running
    main()
