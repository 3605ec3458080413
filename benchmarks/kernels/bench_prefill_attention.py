"""Causal prefill attention per layer call: SDPA one sequence at a time against the C kernel.

SmolLM2's head shapes (9 query heads, 3 KV heads, head dim 64), sequences with no cached prefix
attending to their own K/V:
- `sdpa`: what the torch backend runs without the kernel (torch_paged._prefill): one
  `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` per sequence;
- `kernel`: native_prefill.c built for `--march` (native: this CPU's), one call for all the
  sequences, as the backend makes it once a layer.
Shapes: one sequence of each `--lens`, and a step of `--step` sequences of 128 tokens (2048
tokens: the engine's prefill step at batch 16). Both run interleaved rep by rep, on views into
a fused QKV row as the model's split leaves them; the table gives medians (ms), SDPA's time over
the kernel's, and each one's largest error against float64 on the single sequences.

    python benchmarks/kernels/bench_prefill_attention.py [--dtype bfloat16 float32]
        [--lens 128 512 2048]
        [--step 16] [--reps 9] [--march native] [--threads N]

On a busy machine, time with `--threads 1`: with two threads on two shared cores, a call waits
for whichever thread the scheduler set aside (times bunch at multiples of the time slice).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common.attention.backends.native_prefill import native_prefill, prefill_seqs

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM**-0.5


def qkv(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """q (T, Hq, D), k and v (T, Hkv, D): views into one (T, (Hq + 2 Hkv) D) row each."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    q, k, v = row.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return q.view(num_tokens, HEADS, DIM), *(x.view(num_tokens, KV_HEADS, DIM) for x in (k, v))


def sdpa_each(q, k, v, bounds: list[int]) -> torch.Tensor:
    out = torch.empty_like(q)
    for start, end in zip(bounds, bounds[1:]):
        qh, kh, vh = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=SCALE, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def reference(q, k, v) -> torch.Tensor:
    group = HEADS // KV_HEADS
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    later = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    scores = (qd @ kd.transpose(1, 2) * SCALE).masked_fill(later, float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def candidates(kernel, q, k, v, bounds: list[int]) -> dict:
    seqs = prefill_seqs(bounds[:-1], bounds[1:])
    return {
        "sdpa": lambda: sdpa_each(q, k, v, bounds),
        "kernel": lambda: kernel(q, k, v, seqs, SCALE),
    }


def timed(fns: dict, reps: int) -> dict[str, float]:
    """Median ms of each of `fns`, interleaved rep by rep, after one warm-up call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--step", type=int, default=16, help="sequences of 128 in the step")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--march", default="native")
    parser.add_argument("--threads", type=int, help="torch's (and the kernel's) thread count")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = native_prefill(args.march)
    assert kernel is not None, "the kernel did not build"
    print(f"kernel {kernel.path}, {torch.get_num_threads()} threads")
    print(f"{'dtype':9} {'shape':>10} {'sdpa ms':>9} {'kernel ms':>10} {'ratio':>6} "
          f"{'sdpa err':>9} {'kernel err':>10}")  # fmt: skip
    shapes = [(f"1x{n}", [n]) for n in args.lens] + [(f"{args.step}x128", [128] * args.step)]
    for dtype in (getattr(torch, name) for name in args.dtype):
        for label, lens in shapes:
            bounds = [0]
            for n in lens:
                bounds.append(bounds[-1] + n)
            q, k, v = qkv(bounds[-1], dtype)
            fns = candidates(kernel, q, k, v, bounds)
            ms = timed(fns, args.reps)
            errors = ["", ""]
            if len(lens) == 1 and lens[0] <= 512:
                want = reference(q, k, v)
                errors = [f"{(fn().double() - want).abs().max().item():.1e}" for fn in fns.values()]
            print(f"{str(dtype).removeprefix('torch.'):9} {label:>10} {ms['sdpa']:9.3f} "
                  f"{ms['kernel']:10.3f} {ms['sdpa'] / ms['kernel']:6.2f} {errors[0]:>9} "
                  f"{errors[1]:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
