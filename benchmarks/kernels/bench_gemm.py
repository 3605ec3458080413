"""A linear layer's GEMM from decode to prefill sizes: oneDNN on its packed weight vs the C
kernel on its own (common/model/skinny_gemm.c), in every build this CPU runs.

SmolLM2-135M's four linear shapes of a decoder layer (qkv 960×576, o 576×576, gate/up
3072×576, down 576×1536), `--layers` layers of distinct random weights (30: 212 MB in bf16,
424 MB in fp32, far more than the CPU's caches, as in a real step), M rows of input. One pass
runs every layer's four GEMMs; the table gives the median pass (ms) per path and each path's
GFLOP/s. The paths:
- `onednn`: oneDNN's packed GEMM at this CPU's best instruction set;
- `c-native`: the kernel built for this CPU (`-march=native`);
- `c-x86-64-v3`: the kernel built for AVX2 + FMA, the code an AVX2-only CPU runs;
- `onednn-avx2` (`--avx2-rival`): oneDNN limited to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`,
  `ATEN_CPU_CAPABILITY=avx2`), in a worker process since oneDNN reads that when torch loads:
  the rival of `c-x86-64-v3` on an AVX2-only CPU.
All of them interleaved pass by pass (the worker's pass between the others'), `--reps` rounds,
medians. A path that does not run a dtype here shows "-".

    python benchmarks/kernels/bench_gemm.py [--dtype float32 bfloat16] [--rows 1 2 4 8 16 32 64 128]
        [--avx2-rival]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's packages, here and in the worker

import torch  # noqa: E402

from common.model.packed_linear import can_pack, skinny_gemm, skinny_pack  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
MARCHES = ("native", "x86-64-v3")
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def random_weights(layers: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(n, k, generator=gen).to(dtype) for n, k in SHAPES] for _ in range(layers)]


def onednn_pass(weights: list[list[torch.Tensor]]) -> Callable[[dict], None]:
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in weights]

    def run(xs: dict) -> None:
        for layer in packed:
            for p, (_, k) in zip(layer, SHAPES):
                torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

    return run


def skinny_pass(weights: list[list[torch.Tensor]], march: str) -> Callable[[dict], None] | None:
    if skinny_pack(weights[0][0][:16], march) is None:
        return None
    packed = [[skinny_pack(w, march) for w in ws] for ws in weights]

    def run(xs: dict) -> None:
        for layer in packed:
            for p, (n, k) in zip(layer, SHAPES):
                skinny_gemm(xs[k], p, None, n, march)

    return run


def inputs(rows: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    return {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in SHAPES}


def timed(run: Callable[[dict], None], xs: dict) -> float:
    start = time.perf_counter()
    run(xs)
    return time.perf_counter() - start


class Worker:
    """oneDNN limited to AVX2 in a process of its own: one timed pass per `pass_s(rows)`."""

    def __init__(self, dtype: str, layers: int):
        cmd = [sys.executable, __file__, "--worker", "--dtype", dtype, "--layers", str(layers)]
        env = {**os.environ, **AVX2_ENV}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.runs = self.proc.stdout.readline().strip() == "ready"

    def pass_s(self, rows: int) -> float:
        self.proc.stdin.write(f"{rows}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve_worker(dtype: torch.dtype, layers: int) -> None:
    if not can_pack(torch.device("cpu"), dtype):
        print("no", flush=True)
        return
    run = onednn_pass(random_weights(layers, dtype))
    print("ready", flush=True)
    with torch.inference_mode():
        for line in sys.stdin:
            xs = inputs(int(line), dtype)
            print(timed(run, xs), flush=True)


def bench_dtype(name: str, args: argparse.Namespace) -> None:
    dtype = getattr(torch, name)
    weights = random_weights(args.layers, dtype)
    paths: dict[str, Callable[[dict], None] | None] = {
        "onednn": onednn_pass(weights) if can_pack(torch.device("cpu"), dtype) else None
    }
    for march in MARCHES:
        paths[f"c-{march}"] = skinny_pass(weights, march)
    runs = {label: run for label, run in paths.items() if run is not None}
    worker = Worker(name, args.layers) if args.avx2_rival else None
    labels = [*paths, *(["onednn-avx2"] if worker else [])]
    if worker and worker.runs:
        runs["onednn-avx2"] = None
    for rows in args.rows:
        xs = inputs(rows, dtype)
        times: dict[str, list[float]] = {label: [] for label in runs}
        with torch.inference_mode():
            for _ in range(args.reps + 1):  # the first round warms up
                for label, run in runs.items():
                    times[label].append(worker.pass_s(rows) if run is None else timed(run, xs))
        ms = {label: statistics.median(t[1:]) * 1e3 for label, t in times.items()}
        gflop = 2 * rows * sum(n * k for n, k in SHAPES) * args.layers / 1e9
        cells = [f"{ms[la]:.2f}" if la in ms else "-" for la in labels]
        rates = [f"{gflop / ms[la] * 1e3:.0f}" if la in ms else "-" for la in labels]
        print(f"| {name} | {rows} | {' | '.join(cells)} | {' | '.join(rates)} |")
    if worker:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--avx2-rival", action="store_true", help="also oneDNN limited to AVX2, in a worker"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_worker(getattr(torch, args.dtype[0]), args.layers)
        return
    labels = ["onednn", *(f"c-{m}" for m in MARCHES), *(["onednn-avx2"] * args.avx2_rival)]
    print(
        f"{torch.get_num_threads()} threads; one pass = {args.layers} layers x {len(SHAPES)} "
        f"GEMMs; ms per pass (median of {args.reps}), then GFLOP/s"
    )
    print(f"| dtype | rows | {' | '.join(f'{la} ms' for la in labels)} | {' | '.join(labels)} |")
    print(f"|---|---:|{'---:|' * 2 * len(labels)}")
    for name in args.dtype:
        bench_dtype(name, args)


if __name__ == "__main__":
    main()
