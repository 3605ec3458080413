"""Decode attention per layer call: SDPA on the gathered context, the compiled kernel and the C one.

The torch backend's decode paths (common/attention/backends/torch_paged.py) on SmolLM2's head
shapes (9 query heads, 3 KV heads, head dim 64), a batch of B decodes whose contexts of L tokens
lie in shuffled 16-token blocks, through `TorchPagedBackend.forward` as a layer calls it (the KV
write included):
- `sdpa`: `--enforce-eager`'s path, index_select of K and V, then SDPA with a length mask;
- `fused`: the torch.compile'd kernel, reading K/V by slot inside two fp32 reductions;
- `torch`: of those two, the one the compiled path runs without the C kernel at this shape;
- `c-avx512`, `c-avx2`, `c-plain`: the C kernel (native_decode.c) built for each `--march`
  (native: this CPU's; x86-64-v3: AVX2 and FMA; x86-64-v2: plain C loops);
- `<path> chosen`: the compiled path with a non-AVX-512 build, after its start-up choice per
  batch class between it and the torch path (decode_choice.py).
All run in the same process, interleaved rep by rep in a shuffled order; the table gives medians
(µs), `torch`'s time over each C path's, and the largest error of any path against a float64
reference.
`--cold` streams 64 MB through the caches before every call, as a layer meets its KV in a real
step (the other layers' weights and KV pass through the caches in between). To see torch as on
a CPU without AVX-512, run with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: the compiled
kernel then goes to a private inductor cache, as inductor's cache key leaves that setting out and
an AVX2 kernel loaded by a process on AVX-512 corrupts its heap.

    python benchmarks/kernels/bench_attention.py [--dtype float32 bfloat16] [--batch 2 8 32]
        [--cold]
        [--march native x86-64-v3 x86-64-v2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from common.attention.backends.torch_paged import FUSED_MIN_TOKENS, TorchPagedBackend
from common.attention.metadata import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def decode_batch(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """Metadata, q/k/v of the new tokens and a cache holding every context, in random blocks;
    lengths vary from context/2 to context (the longest is `context`)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g)
    lens[0] = context
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    table = torch.randperm(num_blocks - 1, generator=g)[: batch * per_seq].view(batch, per_seq)
    meta = AttentionMetadata.for_decodes(table, lens, BLOCK)
    q = torch.randn(batch, HEADS, DIM, generator=g).to(dtype)
    k, v = torch.randn(2, batch, KV_HEADS, DIM, generator=g).to(dtype)
    return meta, q, k, v, cache


def reference(meta, q, cache) -> torch.Tensor:
    """float64 attention of each query over its context, read back from the cache."""
    flat = cache.double().view(2, -1, KV_HEADS, DIM)
    out = []
    for i, n in enumerate(meta.seq_lens):
        pos = torch.arange(n)
        slots = meta.block_table[i, pos // BLOCK] * BLOCK + pos % BLOCK
        k, v = (flat[j, slots].transpose(0, 1) for j in (0, 1))  # (Hkv, L, D)
        qh = q[i].double().view(KV_HEADS, -1, DIM)  # (Hkv, G, D)
        out.append(F.scaled_dot_product_attention(qh, k, v, scale=DIM**-0.5).reshape(HEADS, DIM))
    return torch.stack(out)


def measure(paths: dict, batch: int, context: int, dtype: torch.dtype, reps: int, cold) -> dict:
    meta, q, k, v, cache = decode_batch(batch, context, dtype)
    times: dict[str, list[float]] = {name: [] for name in paths}
    row: dict[str, float] = {}
    for name, backend in paths.items():  # first call: compile; and the error
        out = backend.forward(q, k, v, cache, meta, DIM**-0.5, None)
        want = reference(meta, q, cache)
        row[f"{name} err"] = (out.double() - want).abs().max().item()
    order = list(paths)
    for rep in range(reps):
        random.Random(rep).shuffle(order)  # no path always runs after the same other one
        for name in order:
            backend = paths[name]
            took = 0.0
            for _ in range(10):
                if cold is not None:
                    cold.add_(1)
                start = time.perf_counter()
                backend.forward(q, k, v, cache, meta, DIM**-0.5, None)
                took += time.perf_counter() - start
            times[name].append(took / 10 * 1e6)
    for name in paths:
        row[name] = statistics.median(times[name])
    fused_pays = batch > 1 and batch * context >= FUSED_MIN_TOKENS
    row["torch"] = row["fused" if fused_pays else "sdpa"]
    return row


def build_paths(marches: list[str], dtype: torch.dtype) -> dict[str, TorchPagedBackend]:
    """sdpa, fused, then per march the C kernel alone and, where it is not the AVX-512 code,
    the compiled path after its start-up choice."""
    paths = {
        "sdpa": TorchPagedBackend(),
        "fused": TorchPagedBackend(True, fused_min_tokens=0),
    }
    for march in marches:
        native = TorchPagedBackend(native=True, march=march)
        assert native.native is not None, f"the C kernel did not build for -march={march}"
        paths[native.native.path] = native
        if native.native.path != "c-avx512":
            chosen = TorchPagedBackend(True, native=True, march=march)
            kv_cache = torch.empty(2, 1, BLOCK, KV_HEADS, DIM, dtype=dtype)
            chosen.warm_up([kv_cache, kv_cache.clone()], HEADS)
            paths[f"{native.native.path} chosen"] = chosen
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[160, 600, 2000])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    parser.add_argument(
        "--march",
        nargs="+",
        default=["native"],
        help="instruction sets to build the C kernel for (native, x86-64-v3, x86-64-v2)",
    )
    args = parser.parse_args()
    if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-isa-")
    cold = torch.empty(64 << 20, dtype=torch.uint8) if args.cold else None
    print(f"{torch.get_num_threads()} threads; µs per layer call, median of {args.reps}")
    print(f"caches: {'evicted before each call' if args.cold else 'warm'}")
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    for dtype in args.dtype:
        paths = build_paths(args.march, getattr(torch, dtype))
        names = [*paths, "torch"]
        c_paths = [name for name in paths if name.startswith("c-")]
        print()
        print(
            "| dtype | batch | context | "
            + " | ".join(f"{n} µs" for n in names)
            + " | "
            + " | ".join(f"torch / {n}" for n in c_paths)
            + " | worst err |"
        )
        print("|---|---:|---:|" + "---:|" * (len(names) + len(c_paths) + 1))
        for batch in args.batch:
            for context in args.context:
                r = measure(paths, batch, context, getattr(torch, dtype), args.reps, cold)
                err = max(r[f"{n} err"] for n in paths)
                print(
                    f"| {dtype} | {batch} | {context} | "
                    + " | ".join(f"{r[n]:.0f}" for n in names)
                    + " | "
                    + " | ".join(f"{r['torch'] / r[n]:.2f}" for n in c_paths)
                    + f" | {err:.1e} |"
                )


if __name__ == "__main__":
    main()
