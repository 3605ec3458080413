"""KV transfer bandwidth on the device: a request's READ over NIXL next to a device copy of the
same bytes, figures only.

Two NixlTransports over SmolLM2-shaped KV (30 layers of (2, num_blocks, 16, 3, 64) bf16), each
allocated as a worker allocates it (`allocate_kv_caches`): with one GPU both sit on it (VRAM to
VRAM through UCX, cuda_ipc or cuda_copy); with two, the reader's on the second (cuda_ipc between
GPUs). For 512 and 2048 tokens of contiguous blocks: one READ of every layer (as a pull posts
it), one READ a layer (as a push posts its WRITEs), and `dst.copy_(src)` of the same bytes on
the device. Every READ is checked to have landed. On `--device cpu` the same runs in DRAM: it
checks the script.
"""

from __future__ import annotations

import math
import statistics
import time
from types import SimpleNamespace

import torch

from common.kv_cache.tensors import allocate_kv_caches
from common.kv_transfer.nixl.transport import NixlTransport

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 30, 3, 64, 16, 256


def measure(device: str, prompt_lens=(512, 2048), repeats: int = 10) -> dict:
    arch = SimpleNamespace(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    reader = "cuda:1" if device == "cuda" and torch.cuda.device_count() > 1 else device
    remote = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, device)
    local = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, reader)
    for i, t in enumerate(remote):
        t.fill_(i + 1)
    rows = []
    with NixlTransport("gpu-p", remote) as p, NixlTransport("gpu-d", local) as d:
        d.add_peer(p.layout, p.metadata())
        for n in prompt_lens:
            rows.append(_row(d, remote, local, n, repeats))
    return {
        "status": "measured",
        "writer": str(remote[0].device),
        "reader": str(local[0].device),
        "rows": rows,
    }


def _row(d, remote, local, prompt_len: int, repeats: int) -> dict:
    blocks = list(range(1, math.ceil(prompt_len / BLOCK_SIZE) + 1))
    layers = range(NUM_LAYERS)

    def one_read():
        return d.read_layers("gpu-p", layers, blocks, blocks).result(timeout=60)

    def per_layer():
        for future in [d.read_layer("gpu-p", layer, blocks, blocks) for layer in layers]:
            future.result(timeout=60)

    result = one_read()  # warm-up: connects
    for layer in (0, NUM_LAYERS - 1):
        got, want = local[layer][:, blocks], remote[layer][:, blocks].to(local[layer].device)
        assert torch.equal(got, want), f"layer {layer}: the READ did not land"
    src = torch.ones(result.num_bytes // 2, dtype=torch.bfloat16, device=remote[0].device)
    dst = torch.empty_like(src, device=local[0].device)
    gbps = {
        name: result.num_bytes / _median_s(fn, repeats, src.device) / 1e9
        for name, fn in (("read", one_read), ("per_layer_reads", per_layer))
    }
    copy_s = _median_s(lambda: dst.copy_(src), repeats, src.device)
    gbps["device_copy"] = result.num_bytes / copy_s / 1e9
    return {
        "prompt_tokens": prompt_len,
        "mib": round(result.num_bytes / 2**20, 1),
        "descriptors_a_layer": result.num_descriptors // NUM_LAYERS,
        **{f"{name}_gbps": round(v, 2) for name, v in gbps.items()},
        "read_vs_copy": round(gbps["read"] / gbps["device_copy"], 2),
    }


def _median_s(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
