"""Decode attention per layer call: SDPA on the gathered context, the compiled kernel and the C one.

The torch backend's three decode paths (common/attention/backends/torch_paged.py) on SmolLM2's
head shapes (9 query heads, 3 KV heads, head dim 64), a batch of B decodes whose contexts of
L tokens lie in shuffled 16-token blocks, through `TorchPagedBackend.forward` as a layer calls
it (the KV write included):
- `sdpa`: `--enforce-eager`'s path, index_select of K and V, then SDPA with a length mask;
- `fused`: the torch.compile'd kernel, reading K/V by slot inside two fp32 reductions;
- `native`: the C kernel (native_decode.c), the compiled path's choice on a CPU.
All run in the same process, interleaved rep by rep; the table gives medians (µs), the ratios
to `native`, and each path's largest error against a float64 reference. `--cold` streams 64 MB
through the caches before every call, as a layer meets its KV in a real step (the other layers'
weights and KV pass through the caches in between).

    python benchmarks/bench_attention.py [--dtype float32 bfloat16] [--batch 2 8 32] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common.attention.backends.torch_paged import TorchPagedBackend
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
    last = lens - 1
    slots = table.gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=list(range(batch + 1)),
        seq_lens=lens.tolist(),
        block_table=table,
        seq_lens_tensor=lens,
        num_decodes=batch,
        block_size=BLOCK,
        request_ids=[str(i) for i in range(batch)],
    )
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
    for _ in range(reps):
        for name, backend in paths.items():
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
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[160, 600, 2000])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = parser.parse_args()
    cold = torch.empty(64 << 20, dtype=torch.uint8) if args.cold else None
    print(f"{torch.get_num_threads()} threads; µs per layer call, median of {args.reps}")
    print(f"caches: {'evicted before each call' if args.cold else 'warm'}")
    print(
        "| dtype | batch | context | sdpa µs | fused µs | native µs | sdpa / native "
        "| fused / native | sdpa err | fused err | native err |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtype:
        paths = {
            "sdpa": TorchPagedBackend(),
            "fused": TorchPagedBackend(True, fused_min_tokens=0),
            "native": TorchPagedBackend(native=True),
        }
        assert paths["native"].native is not None, "the C kernel did not build here"
        for batch in args.batch:
            for context in args.context:
                r = measure(paths, batch, context, getattr(torch, dtype), args.reps, cold)
                print(
                    f"| {dtype} | {batch} | {context} | {r['sdpa']:.0f} | {r['fused']:.0f} | "
                    f"{r['native']:.0f} | {r['sdpa'] / r['native']:.2f} | "
                    f"{r['fused'] / r['native']:.2f} | {r['sdpa err']:.1e} | "
                    f"{r['fused err']:.1e} | {r['native err']:.1e} |"
                )


if __name__ == "__main__":
    main()
