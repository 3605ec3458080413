"""Engine throughput on SmolLM2-135M vs transformers' batched `generate`, and vs the roofline.

For each concurrency: the same prompts (128 random token ids each), 128 new tokens each, greedy,
EOS ignored. Output tokens/s of this engine and of transformers in the same run, their ratio,
and the fraction of this machine's roofline: per step, max(FLOPs / matmul rate, weight bytes /
memory rate), with both rates measured here first.

    python benchmarks/bench_engine.py [--concurrency 1 8 32] [--skip-hf] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import time

import torch

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def measure_matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def measure_memory_gbps(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    x = torch.ones(num_bytes // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()  # a pure read of the whole tensor, like reading weights
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


def model_costs(model: torch.nn.Module) -> tuple[float, float, float]:
    """(matmul FLOPs per token, weight bytes read per decode step, attention FLOPs per context
    token per layer-token)."""
    cfg = model.config
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    lm_head = cfg.vocab_size * cfg.hidden_size  # tied or not, the head is read every step
    flops_per_token = 2 * (weights + lm_head)
    bytes_per_step = 4 * (weights + lm_head)
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV per key
    return flops_per_token, bytes_per_step, attn_flops


def roofline_tps(costs, gflops, gbps, batch, prompt_len, new_tokens) -> float:
    flops_tok, bytes_step, attn = costs
    prefill = batch * prompt_len * (flops_tok + attn * prompt_len / 2) / (gflops * 1e9)
    decode = 0.0
    for i in range(new_tokens - 1):
        ctx = prompt_len + i
        step_flops = batch * (flops_tok + attn * ctx)
        decode += max(step_flops / (gflops * 1e9), bytes_step / (gbps * 1e9))
    return batch * new_tokens / (prefill + decode)


def bench_ours(llm: LLM, prompts, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], SamplingParams(max_tokens=2))  # warm-up
    llm.engine.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    llm.engine.pool.reset_prefix_cache()
    return len(prompts) * new_tokens / elapsed


def bench_hf(model_dir, prompts, new_tokens: int) -> float:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        hf.generate(ids[:1, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        hf.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    args = parser.parse_args()

    gflops, gbps = measure_matmul_gflops(), measure_memory_gbps()
    llm = LLM(
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=2048,
        enforce_eager=args.enforce_eager,
    )
    model_dir = llm.engine.config.model.model_dir
    costs = model_costs(llm.engine.model)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.arch.vocab_size
    prompts = torch.randint(100, vocab, (max(args.concurrency), args.prompt_len), generator=g)
    print(
        f"machine: {torch.get_num_threads()} threads, matmul {gflops:.0f} GFLOP/s, "
        f"memory read {gbps:.1f} GB/s; model: {costs[0] / 2e6:.0f} M matmul params, "
        f"{costs[1] / 1e6:.0f} MB read per decode step"
    )
    print(
        f"{'batch':>5} | {'engine tok/s':>12} | {'transformers':>12} | {'ratio':>5} | "
        f"{'roofline tok/s':>14} | {'of roofline':>11}"
    )
    for c in args.concurrency:
        batch = prompts[:c].tolist()
        ours = bench_ours(llm, batch, args.new_tokens)
        hf = float("nan") if args.skip_hf else bench_hf(model_dir, batch, args.new_tokens)
        roof = roofline_tps(costs, gflops, gbps, c, args.prompt_len, args.new_tokens)
        print(
            f"{c:>5} | {ours:>12.1f} | {hf:>12.1f} | {ours / hf:>5.2f} | {roof:>14.1f} | "
            f"{ours / roof:>10.0%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
