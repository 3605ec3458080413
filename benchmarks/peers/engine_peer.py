"""This engine's side of bench_engine.py's interleaved runs (benchmarks/peers/protocol.py's
protocol).

    PEER_ARGS='{"concurrency": [1, 8, 32], "new_tokens": 128}' \
        python -m benchmarks.peers.engine_peer PROMPTS_JSON --dtype float32 [--enforce-eager]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.peers.protocol import serve
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from common.native.choice import summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", help="a JSON list of token-id lists")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--enforce-eager", action="store_true")
    a = ap.parse_args()
    with open(a.prompts) as f:
        prompts = json.load(f)
    start = time.perf_counter()
    llm = LLM(
        dtype=a.dtype,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        enforce_eager=a.enforce_eager,
    )

    def generate(batch: int, new_tokens: int) -> None:
        llm.engine.pool.reset_prefix_cache()  # every round computes its prompts anew
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate(prompts[:batch], params)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    dtype = str(llm.engine.config.model.torch_dtype).removeprefix("torch.")
    info = {"start_s": round(time.perf_counter() - start, 1), "dtype": dtype}
    info["threads"] = torch.get_num_threads()
    serve(generate, info | {"kernels": summary()})


if __name__ == "__main__":
    main()
