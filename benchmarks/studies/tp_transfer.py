"""KV transfer between tensor-parallel layouts over NIXL: head-sliced descriptors vs staging.

Two NixlTransports in this process over KV shaped like SmolLM2's (30 layers, 3 KV heads of 64,
fp32, blocks of 16), each side one shard (TP 1) or two (TP 2: heads 0 and 1-2, as
common/parallel/shard.py splits 3 heads over 2 ranks), allocated as a worker allocates them. A
request's pull is one READ of every layer, its push one WRITE per layer (docs/design.md, "KV
between TP sizes"). Between different splits, two ways: `direct` moves each token's slice of
heads straight between the shards (a descriptor per token slot), `staged` (what the workers
do) moves whole blocks through a staging buffer in the other side's layout, the copy between
buffer and shards included in the time. Per pair, op, way and prompt length: the median time,
descriptors per layer and the ratio to TP 1 -> TP 1 in the same run. Every transfer's last
layer is checked: D's heads equal P's.

    .venv/bin/python benchmarks/studies/tp_transfer.py [--prompt-lens 128 512 2048] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # before nixl is imported

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 30, 3, 64, 16, 160
SPLITS = {1: [(0, 3)], 2: [(0, 1), (1, 3)]}  # TP size -> each rank's KV heads [first, stop)
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2)]  # (P's TP, D's TP)


def shards(tp: int, fill: bool) -> list:
    from common.kv_cache.tensors import huge_page_zeros
    from common.kv_transfer.layout import ShardTensors

    out = []
    for first, stop in SPLITS[tp]:
        shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, stop - first, HEAD_DIM)
        kv = huge_page_zeros(shape, torch.float32)
        if fill:  # each head's value is its index: a misplaced head shows
            heads = torch.arange(first, stop, dtype=torch.float32).view(1, 1, 1, 1, -1, 1)
            kv += heads + 1
        out.append(ShardTensors(first, list(kv.unbind(0))))
    return out


def full_heads(kv: list, blocks: list[int]) -> torch.Tensor:
    """Layer 0 and the last of `blocks`, every head once, in head order."""
    parts, seen = [], set()
    for shard in kv:
        t = shard.kv_caches[-1][:, blocks]
        for i in range(t.shape[3]):
            if shard.first_head + i not in seen:
                seen.add(shard.first_head + i)
                parts.append((shard.first_head + i, t[:, :, :, i]))
    return torch.stack([p for _, p in sorted(parts, key=lambda p: p[0])], dim=3)


def pull(d, pool, p_layout, d_kv, blocks: list[int], staged: bool):
    """One pull of `blocks` (the same ids on both sides); the READ's result."""
    if not staged:
        return d.read_layers("p", range(NUM_LAYERS), blocks, blocks).result(timeout=60)
    stage = pool.for_read(p_layout, len(blocks))
    stage.futures.append(
        d.read_layers("p", range(NUM_LAYERS), range(len(blocks)), blocks, via=stage.layout)
    )
    result = stage.futures[0].result(timeout=60)
    for layer in range(NUM_LAYERS):
        stage.scatter(layer, d_kv, blocks)
    pool.settle()
    return result


def push(p, pool, d_layout, p_kv, blocks: list[int], staged: bool):
    """One push of `blocks`: a WRITE per layer, as P posts them (staged: each layer gathered
    into D's layout first); the first WRITE's result, once all have landed."""
    stage = staged and pool.for_write(d_layout, len(blocks))
    futures = []
    for layer in range(NUM_LAYERS):
        if stage:
            stage.gather(layer, p_kv, blocks)
        local = range(len(blocks)) if stage else blocks
        futures.append(p.write_layer("d", layer, local, blocks, via=stage and stage.layout))
    if stage:
        stage.futures += futures
    results = [f.result(timeout=60) for f in futures]
    pool.settle()
    return results[0]


def bench_pair(p_tp: int, d_tp: int, staged: bool, prompt_lens: list[int], repeats: int):
    from common.kv_transfer.nixl.staging import StagingPool
    from common.kv_transfer.nixl.transport import NixlTransport

    p_kv, d_kv = shards(p_tp, fill=True), shards(d_tp, fill=False)
    rows = []
    with NixlTransport("p", p_kv) as p, NixlTransport("d", d_kv) as d:
        d.add_peer(p.layout, p.metadata())
        p.add_peer(d.layout, d.metadata())
        pools = {"pull": StagingPool(d, d_kv), "push": StagingPool(p, p_kv)}
        for op, n in ((op, n) for op in ("pull", "push") for n in prompt_lens):
            blocks = list(range(1, -(-n // BLOCK_SIZE) + 1))

            def once(op=op, blocks=blocks):
                if op == "pull":
                    return pull(d, pools[op], p.layout, d_kv, blocks, staged)
                return push(p, pools[op], d.layout, p_kv, blocks, staged)

            for shard in d_kv:  # what lands (in the last layer) is checked
                shard.kv_caches[-1].zero_()
            once()  # connects; the buffer is made
            assert torch.equal(full_heads(d_kv, blocks), full_heads(p_kv, blocks))
            times, results = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                results.append(once())
                times.append(time.perf_counter() - start)
            descs = results[0].num_descriptors // (NUM_LAYERS if op == "pull" else 1)
            rows.append(
                dict(
                    pair=f"P TP{p_tp} -> D TP{d_tp}",
                    op=op,
                    way="staged" if staged else "direct",
                    tokens=n,
                    ms=statistics.median(times) * 1e3,
                    descs=descs,
                    mb=results[0].num_bytes / 1e6 * (1 if op == "pull" else NUM_LAYERS),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    a = parser.parse_args()
    ways = [(p, d, staged) for p, d in PAIRS for staged in ((False, True) if p != d else (False,))]
    rows = [r for p, d, st in ways for r in bench_pair(p, d, st, a.prompt_lens, a.repeats)]
    base = {(r["op"], r["tokens"]): r["ms"] for r in rows if r["pair"] == "P TP1 -> D TP1"}
    print("| pair | op | way | tokens | MB | descriptors a layer | ms | ÷ TP1->TP1 | GB/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["op"] == "push"):
        ratio = r["ms"] / base[(r["op"], r["tokens"])]
        print(
            f"| {r['pair']} | {r['op']} | {r['way']} | {r['tokens']} | {r['mb']:.1f} "
            f"| {r['descs']} | {r['ms']:.2f} | {ratio:.2f} | {r['mb'] / r['ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
