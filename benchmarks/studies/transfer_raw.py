"""KV transfer over NIXL, the raw transport (part 1 of benchmarks/studies/bench_transfer.py): two
NixlTransports in this process over KV tensors shaped like SmolLM2's (30 layers of
(2, 600, 16, 3, 64) fp32), allocated as a worker allocates them (2 MiB pages, one NIXL region)
and as before (4 KiB pages, a region a layer). Per prompt length: a request's READ of every
layer, one READ a layer, the transport's ceiling (one NIXL READ of the same bytes as a single
descriptor), a torch copy of the same bytes and one side's KV checksums.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch

# SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 on CPU; the server's default block size
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
NUM_BLOCKS = 600


@dataclass
class RawRow:
    prompt_len: int
    huge_pages: bool
    num_blocks: int
    descriptors_per_layer: int
    num_bytes: int
    read_s: float  # the request's blocks of every layer in one READ, as a pull does
    per_layer_s: float  # one READ per layer, all submitted at once (push posts this way)
    ceiling_s: float  # one NIXL READ of the same bytes as a single descriptor
    copy_s: float  # torch copy of the same bytes
    post_us: float  # posting one layer's READ: descriptors and handle
    checksum_s: float  # --kv-checksum: one side's sums over every layer of these blocks


def bench_raw(prompt_lens: list[int], repeats: int) -> list[RawRow]:
    from common.kv_transfer.nixl.transport import NixlTransport

    rows = []
    for huge in (True, False):
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        remote_kv = [t.fill_(1.0) for t in _kv_caches(shape, huge)]
        local_kv = _kv_caches(shape, huge)  # touched (zeroed): no page faults
        with NixlTransport("raw-p", remote_kv) as p, NixlTransport("raw-d", local_kv) as d:
            d.add_peer(p.layout, p.metadata())
            for n in prompt_lens:
                rows.append(_raw_row(d, local_kv, n, huge, repeats))
        del remote_kv, local_kv
        gc.collect()
    return rows


def _kv_caches(shape: tuple[int, ...], huge_pages: bool) -> list[torch.Tensor]:
    """As a worker allocates them: huge pages, every layer a view of one mapping (one NIXL
    region); or, as before, one plain torch.zeros a layer (a region each)."""
    if huge_pages:
        return list(_tensor((NUM_LAYERS, *shape), True).unbind(0))
    return [torch.zeros(shape) for _ in range(NUM_LAYERS)]


def _tensor(shape: tuple[int, ...], huge_pages: bool) -> torch.Tensor:
    from common.kv_cache.tensors import huge_page_zeros

    return huge_page_zeros(shape, torch.float32) if huge_pages else torch.zeros(shape)


def _raw_row(d, local_kv, prompt_len: int, huge: bool, repeats: int) -> RawRow:
    from common.kv_transfer.nixl.checksum import request_checksums

    num_blocks = math.ceil(prompt_len / BLOCK_SIZE)
    blocks = list(range(1, num_blocks + 1))  # contiguous, as the allocator gives them
    read_all_layers(d, blocks)  # warm-up (the first READ also connects)
    reads = [read_all_layers(d, blocks) for _ in range(repeats)]
    per_layer = [read_each_layer(d, blocks) for _ in range(repeats)]
    num_bytes = reads[0][1]
    src, dst = _tensor((num_bytes // 4,), huge).fill_(1.0), _tensor((num_bytes // 4,), huge)
    ceiling = Ceiling(src, dst)
    ceiling.read()  # warm-up (connects)
    assert torch.equal(src, dst), "the ceiling READ did not land"
    ceilings = [_timed(ceiling.read) for _ in range(repeats)]
    del ceiling  # its agents go before the memory they registered
    dst.copy_(src)  # warm-up
    copies = [_timed(lambda: dst.copy_(src)) for _ in range(repeats)]
    request_checksums(local_kv, blocks)  # warm-up
    sums = [_timed(lambda: request_checksums(local_kv, blocks)) for _ in range(repeats)]
    return RawRow(
        prompt_len,
        huge,
        num_blocks,
        descriptors_per_layer=reads[0][2] // NUM_LAYERS,
        num_bytes=num_bytes,
        read_s=statistics.median(r[0] for r in reads),
        per_layer_s=statistics.median(per_layer),
        ceiling_s=statistics.median(ceilings),
        copy_s=statistics.median(copies),
        post_us=statistics.median(r[3] for r in reads) * 1e6 / NUM_LAYERS,
        checksum_s=statistics.median(sums),
    )


def read_all_layers(d, blocks: list[int]) -> tuple[float, int, int, float]:
    """(seconds, bytes, descriptors, posting seconds) of one READ of every layer."""
    start = time.perf_counter()
    result = d.read_layers("raw-p", range(NUM_LAYERS), blocks, blocks).result(timeout=60)
    elapsed = time.perf_counter() - start
    return elapsed, result.num_bytes, result.num_descriptors, result.post_s


def read_each_layer(d, blocks: list[int]) -> float:
    """Seconds of one READ per layer, all submitted at once."""
    start = time.perf_counter()
    futures = [d.read_layer("raw-p", layer, blocks, blocks) for layer in range(NUM_LAYERS)]
    for future in futures:
        future.result(timeout=60)
    return time.perf_counter() - start


class Ceiling:
    """The transport's ceiling: `src` into `dst` as one descriptor, one NIXL READ, between two
    agents of their own (separate from the transports under test)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        from common.kv_transfer.nixl.agent import create_agent

        self.p, self.d = create_agent("ceiling-p", 1000), create_agent("ceiling-d", 1000)
        self.p.register_memory([src])
        self.d.register_memory([dst])
        self.d.add_remote_agent(self.p.get_agent_metadata())  # after registering: it says where
        nbytes = src.numel() * src.element_size()
        self.local = self.d.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
        self.remote = self.d.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")

    def read(self) -> None:
        handle = self.d.initialize_xfer("READ", self.local, self.remote, "ceiling-p")
        state = self.d.transfer(handle)
        while state != "DONE":
            assert state == "PROC", f"ceiling READ: {state}"
            state = self.d.check_xfer_state(handle)
        self.d.release_xfer_handle(handle)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_raw(rows: list[RawRow], repeats: int) -> None:
    print(
        f"\n### Raw transport: a request's KV ({NUM_LAYERS} layers) in one READ, and one READ a"
        " layer, vs the transport's ceiling (one descriptor) and a torch copy of the same bytes"
        f" (median of {repeats})\n"
    )
    print(
        "| prompt tokens | KV pages, NIXL regions | blocks | descriptors a layer | MiB | READ GB/s"
        " | per-layer READs GB/s | ceiling GB/s | torch copy GB/s | READ / ceiling (goal ≥ 0.9)"
        " | READ / copy (goal ≥ 0.6) | posting µs a layer | READ ms | checksum ms (one side) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        times = (r.read_s, r.per_layer_s, r.ceiling_s, r.copy_s)
        read, per_layer, ceiling, copy = (r.num_bytes / t / 1e9 for t in times)
        pages = "2 MiB, one region" if r.huge_pages else "4 KiB, a region a layer"
        cells = [r.prompt_len, pages, r.num_blocks]
        cells += [r.descriptors_per_layer, f"{r.num_bytes / 2**20:.1f}"]
        cells += [f"{read:.2f}", f"{per_layer:.2f}", f"{ceiling:.2f}", f"{copy:.2f}"]
        cells += [f"{read / ceiling:.2f}", f"{read / copy:.2f}", f"{r.post_us:.1f}"]
        print_row([*cells, f"{r.read_s * 1e3:.1f}", f"{r.checksum_s * 1e3:.1f}"])


def print_row(cells: list) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |")
