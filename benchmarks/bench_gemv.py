"""Decode-step GEMMs at a few rows: oneDNN on packed weights vs the C kernel (common/model/gemv.c).

SmolLM2-135M's four linear shapes of a decoder layer (qkv 960×576, o 576×576, gate/up
3072×576, down 576×1536), 30 layers of distinct random weights (212 MB in bf16, 424 MB in fp32:
far more than the CPU's caches, as in a real step), M rows of input. One pass runs the 120
GEMMs; the table gives the median pass (ms), the weight bytes read per second, and the ratio.
Both paths interleaved pass by pass in one process.

    python benchmarks/bench_gemv.py [--dtype float32 bfloat16] [--rows 1 2 4 8] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.model.packed_linear import PackedLinear, can_pack, gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def run_onednn(weights, packed, xs) -> None:
    for layer in packed:
        for p, (_, k) in zip(layer, SHAPES):
            torch.ops.mkldnn._linear_pointwise(xs[k], p.packed_weight, None, "none", [], "")


def run_c(weights, packed, xs) -> None:
    for layer in weights:
        for w, (_, k) in zip(layer, SHAPES):
            gemv(xs[k], w, None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads; one pass = {LAYERS} layers x {len(SHAPES)} GEMMs")
    print("| dtype | rows | oneDNN ms | C ms | oneDNN GB/s | C GB/s | oneDNN / C |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtype:
        dtype = getattr(torch, name)
        if not can_pack(torch.device("cpu"), dtype):
            print(f"| {name} | oneDNN has no native {name} here |")
            continue
        weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
        packed = [[PackedLinear(w) for w in layer] for layer in weights]
        gigabytes = sum(w.numel() * w.element_size() for layer in weights for w in layer) / 1e9
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
            if gemv(xs[576], weights[0][0], None) is None:
                print(f"| {name} | {rows} | the C kernel does not run here |")
                continue

            times = {"onednn": [], "c": []}
            with torch.inference_mode():
                for _ in range(args.reps):
                    for label, run in (("onednn", run_onednn), ("c", run_c)):
                        start = time.perf_counter()
                        run(weights, packed, xs)
                        times[label].append(time.perf_counter() - start)
            a, c = (statistics.median(times[k]) for k in ("onednn", "c"))
            print(
                f"| {name} | {rows} | {a * 1e3:.2f} | {c * 1e3:.2f} | {gigabytes / a:.1f} | "
                f"{gigabytes / c:.1f} | {a / c:.2f} |"
            )


if __name__ == "__main__":
    main()
