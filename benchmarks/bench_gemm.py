"""A linear layer's GEMM from decode to prefill sizes: oneDNN on its packed weight vs the C
kernel on its own (common/model/skinny_gemm.c).

SmolLM2-135M's four linear shapes of a decoder layer (qkv 960×576, o 576×576, gate/up
3072×576, down 576×1536), `--layers` layers of distinct random weights (30: 212 MB in bf16,
424 MB in fp32, far more than the CPU's caches, as in a real step), M rows of input. One pass
runs every layer's four GEMMs; the table gives the median pass (ms), GFLOP/s, the weight bytes
read per second, and the ratio. Both interleaved pass by pass in one process.

    python benchmarks/bench_gemm.py [--dtype float32 bfloat16] [--rows 1 2 4 8 16 32 64 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.model.packed_linear import can_pack, skinny_gemm, skinny_pack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def run_onednn(layers, xs) -> None:
    for layer in layers:
        for p, (_, k) in zip(layer, SHAPES):
            torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")


def run_skinny(layers, xs) -> None:
    for layer in layers:
        for p, (n, k) in zip(layer, SHAPES):
            skinny_gemm(xs[k], p, None, n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(
        f"{torch.get_num_threads()} threads; one pass = {args.layers} layers x {len(SHAPES)} GEMMs"
    )
    print("| dtype | rows | oneDNN ms | C ms | oneDNN GFLOP/s | C GFLOP/s | C GB/s | oneDNN / C |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtype:
        dtype = getattr(torch, name)
        if (
            not can_pack(torch.device("cpu"), dtype)
            or skinny_pack(torch.zeros(16, 64, dtype=dtype)) is None
        ):
            print(f"| {name} | oneDNN or the C kernel does not run {name} here |")
            continue
        weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(args.layers)]
        onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in weights]
        skinny = [[skinny_pack(w) for w in ws] for ws in weights]
        gigabytes = sum(w.numel() * w.element_size() for ws in weights for w in ws) / 1e9
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
            gflop = 2 * rows * sum(n * k for n, k in SHAPES) * args.layers / 1e9
            times = {"onednn": [], "c": []}
            with torch.inference_mode():
                for _ in range(args.reps):
                    for label, run, packed in (
                        ("onednn", run_onednn, onednn),
                        ("c", run_skinny, skinny),
                    ):
                        start = time.perf_counter()
                        run(packed, xs)
                        times[label].append(time.perf_counter() - start)
            a, c = (statistics.median(times[k]) for k in ("onednn", "c"))
            print(
                f"| {name} | {rows} | {a * 1e3:.2f} | {c * 1e3:.2f} | {gflop / a:.0f} | "
                f"{gflop / c:.0f} | {gigabytes / c:.1f} | {a / c:.2f} |"
            )


if __name__ == "__main__":
    main()
