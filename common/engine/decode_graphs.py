"""Decode steps replayed as captured CUDA graphs, one graph per batch size (a "bucket").

A step that holds only decodes (one new token a sequence), moves no KV and has at most the
largest bucket's sequences runs the graph of the smallest bucket that holds it: its inputs
and metadata are copied into static buffers, the graph is replayed, and the first rows of its
output are the step's hidden states. A replay launches the step's kernels with no Python
between them: no dynamo guards, no per-layer op and decorator calls. Every other step
(prefill chunks, a batch too large, a step with KV transfers) runs the forward as before.

- **Static metadata.** Each bucket's `AttentionMetadata` views the static buffers. The
  sequences' lengths exist only on the device (`seq_lens_tensor`); the Python `seq_lens` hold
  the capture's bound, `max_model_len`, for every sequence (common/attention/metadata.py).
  Only a backend that reads each context up to its device-side length is as fast captured as
  eager (`AttentionBackend.decode_graphs`): the default sizes capture only for such a backend.
- **Padding.** Rows past the batch decode a one-token sequence in the pad block, a KV block
  the block pool never hands out (the engine keeps the cache's last block back), so they write
  and read no request's KV. Their outputs are dropped.
- **KV transfer.** The decorator's connector calls are Python, run at each layer: a step with
  connector metadata never replays a graph.
- **On a CPU** there are no graphs. Sizes given explicitly there run each decode step through
  the same static buffers and metadata, uncaptured: the padding and the static metadata are
  checked on CPU this way (tests/test_decode_graphs.py); the capture itself only on a GPU
  (tests/gpu/check.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from common.attention.context import ForwardContext, forward_context
from common.attention.metadata import AttentionMetadata
from common.config import EngineConfig

logger = logging.getLogger(__name__)

# the batch sizes captured by default on CUDA (up to --max-num-seqs, which is added)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) → hidden


def decode_graph_sizes(
    config: EngineConfig, device: torch.device, backend_fits: bool, tp, spare_block: bool
) -> tuple[int, ...]:
    """The batch sizes an engine captures (logged with the reason): --cuda-graph-sizes wins;
    by default `DEFAULT_SIZES` up to --max-num-seqs (and it) on CUDA with a backend that
    fits (`AttentionBackend.decode_graphs`); none with --enforce-eager, with tensor
    parallelism (`tp`; the other ranks run their forward eagerly) or with no KV block to
    spare for the padding (`spare_block`)."""
    sizes, why = _sizes(config, device, backend_fits, tp is not None)
    if sizes and not spare_block:
        sizes, why = (), "no KV block to spare for the padding"
    logger.info("decode graphs: %s (%s)", " ".join(map(str, sizes)) or "none", why)
    return sizes


def _sizes(config: EngineConfig, device: torch.device, backend_fits: bool, tensor_parallel: bool):
    mc = config.model
    if mc.enforce_eager:
        return (), "--enforce-eager"
    if tensor_parallel:
        return (), "not with tensor parallelism"
    if mc.cuda_graph_sizes is not None:
        sizes = tuple(sorted(set(mc.cuda_graph_sizes)))
        return sizes, "--cuda-graph-sizes" if sizes else "--cuda-graph-sizes is empty"
    if device.type != "cuda":
        return (), f"no CUDA graphs on {device.type}"
    if not backend_fits:
        return (), "the attention backend reads up to max_model_len in a captured decode"
    max_num_seqs = config.scheduler.max_num_seqs
    return tuple(sorted({s for s in DEFAULT_SIZES if s < max_num_seqs} | {max_num_seqs})), "default"


class DecodeGraphs:
    """The static buffers, each size's metadata over them and (on CUDA) its captured graph:
    `fits(meta)` says whether a step may run here, `run(...)` runs it, `capture()` records
    the graphs at start-up."""

    def __init__(
        self,
        forward: Forward,
        ctx: ForwardContext,
        sizes: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        pad_block: int,
    ):
        assert sizes and min(sizes) >= 1, f"bad graph sizes {sizes}"
        device = next(iter(ctx.kv_caches.values())).device
        self.forward = forward
        self.ctx = ctx  # layers and caches; its metadata is set per bucket
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pad_slot = pad_block * block_size
        self.pad_block = pad_block
        self.captured = device.type == "cuda"
        n, width = self.sizes[-1], -(-max_model_len // block_size)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions, self.slot_mapping = zeros(n), zeros(n), zeros(n)
        self.seq_lens, self.block_table = zeros(n), zeros(n, width)
        self.metas = {size: self._metadata(size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays: Counter[int] = Counter()  # by bucket
        self.capture_bytes = 0  # device memory the captured graphs took

    @property
    def num_steps(self) -> int:
        return sum(self.num_replays.values())

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether the step of `meta` is one a graph runs (decodes only, few enough)."""
        return (
            meta.num_decodes == meta.num_tokens <= self.sizes[-1]
            and meta.block_table.shape[1] <= self.block_table.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The step's hidden states (B, hidden), from the bucket's graph."""
        size = next(s for s in self.sizes if s >= meta.num_seqs)
        self._load(input_ids, positions, meta, size)
        self.num_replays[size] += 1
        if not self.captured:
            return self._forward(size)[: meta.num_seqs]
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[: meta.num_seqs]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's graph (CUDA; largest first, so that the smaller ones reuse
        its memory pool); returns the seconds it took, and keeps the memory in
        `capture_bytes`. Each bucket runs twice eagerly first: whatever compiles or autotunes
        for its shape does so outside the capture."""
        start, free = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool = None
        for size in reversed(self.sizes):
            self._pad(0, size)
            for _ in range(2):
                self._forward(size)
            graph = torch.cuda.CUDAGraph()
            # NOTE: thread-local: a NIXL/UCX thread's CUDA calls must not void the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        self.capture_bytes = free - torch.cuda.mem_get_info()[0]
        return time.perf_counter() - start

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.metas[size]
        meta.memo.clear()  # derived once per run (uncaptured) or once in the capture
        ctx = ForwardContext(meta, self.ctx.layers, self.ctx.kv_caches)  # no connector
        with forward_context(ctx):
            return self.forward(self.input_ids[:size], self.positions[:size])

    def _load(self, input_ids, positions, meta: AttentionMetadata, size: int) -> None:
        b, width = meta.num_seqs, meta.block_table.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens_tensor)
        # NOTE: columns past `width` keep older block ids: valid ids, past every length
        self.block_table[:b, :width].copy_(meta.block_table)
        self._pad(b, size)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 of the pad block."""
        if start == end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.pad_slot
        self.seq_lens[start:end] = 1
        self.block_table[start:end, 0] = self.pad_block

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[self.max_model_len] * size,  # a bound: the lengths are on the device
            block_table=self.block_table[:size],
            seq_lens_tensor=self.seq_lens[:size],
            num_decodes=size,
            block_size=self.block_size,
            request_ids=[""] * size,
            query_start_loc_tensor=torch.arange(
                size + 1, dtype=torch.int32, device=self.slot_mapping.device
            ),
        )
