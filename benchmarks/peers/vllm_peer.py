"""vLLM's side of bench_engine.py's interleaved runs (benchmarks/peers/protocol.py's protocol): runs
in vLLM's own virtualenv and never imports pdserve (protocol.py is standard library only).

    PEER_ARGS='{"concurrency": [1, 8, 32], "new_tokens": 128}' \
        <vllm venv>/bin/python benchmarks/peers/vllm_peer.py MODEL_DIR PROMPTS_JSON --dtype float32

Offline `LLM.generate`, prefix caching off (each round computes its prompts anew, as on the
engine's side). The engine core runs in-process or as a second process by
VLLM_ENABLE_V1_MULTIPROCESSING, its OMP threads bound by VLLM_CPU_OMP_THREADS_BIND: the caller
sets both.
"""

from __future__ import annotations

import argparse
import json
import time

from protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts", help="a JSON list of token-id lists")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--enforce-eager", action="store_true")
    a = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    with open(a.prompts) as f:
        prompts = json.load(f)
    start = time.perf_counter()
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_num_seqs=len(prompts),
        max_model_len=len(prompts[0]) + 256,
        enable_prefix_caching=False,
        enforce_eager=a.enforce_eager,
        seed=0,
    )

    def generate(batch: int, new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
        requests = [{"prompt_token_ids": p} for p in prompts[:batch]]
        outs = llm.generate(requests, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    serve(generate, {"start_s": round(time.perf_counter() - start, 1), "version": vllm.__version__})


if __name__ == "__main__":  # vLLM's engine core spawns: the guard keeps children from re-running
    main()
