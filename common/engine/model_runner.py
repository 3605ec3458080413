"""The model runner: prepare inputs → run the model in a forward context → sample.

A step's batch is flattened: decodes (one new token) first, then prefill chunks. Only a request
whose computed tokens catch up with its known tokens this step is sampled. A step of decodes
only that moves no KV may replay a captured CUDA graph of the forward instead (decode_graphs.py).

With tensor parallelism (`plans`, common/parallel/) this is rank 0: before each forward it
broadcasts the step's plan, and the other ranks run the same forward on their shards.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from common.attention.context import ForwardContext, forward_context
from common.attention.metadata import AttentionMetadata
from common.engine.compiled import CompiledModel
from common.engine.decode_graphs import DecodeGraphs
from common.engine.request import Request
from common.engine.sampler import SampledToken, Sampler
from common.engine.structured import GrammarMasks
from common.kv_transfer.base import KVConnector
from common.model.llama import LlamaForCausalLM
from common.parallel.plan import PlanChannel, StepPlan

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) last token of each sampled request
    sample_reqs: list[Request]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        connector: KVConnector | None = None,
        enforce_eager: bool = True,
        plans: PlanChannel | None = None,
        kv_shards: list | None = None,
        graph_sizes: tuple[int, ...] = (),
        max_model_len: int = 0,
        pad_block: int = -1,
        masks: GrammarMasks | None = None,
    ):
        """`graph_sizes`: decode batch sizes replayed as CUDA graphs (decode_graphs.py), whose
        padding rows write KV block `pad_block`, one the block pool never hands out."""
        self.model = model
        self.plans = plans
        self.forward = model if enforce_eager else CompiledModel(model, device, kv_caches[0].dtype)
        self.layers = model.attention_layers()
        self.kv_caches = dict(zip(self.layers, kv_caches))
        self.block_size = block_size
        self.sampler = sampler
        self.masks = masks  # structured outputs' token masks
        self.device = device
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches, kv_shards)
        self.compile_seconds = 0.0 if enforce_eager else self.warm_up()
        self.graphs: DecodeGraphs | None = None
        self.capture_seconds = 0.0
        if graph_sizes:
            assert pad_block >= 0 and plans is None, "graphs need a pad block and one rank"
            ctx = ForwardContext(None, self.layers, self.kv_caches)
            self.graphs = DecodeGraphs(
                self.forward, ctx, graph_sizes, block_size, max_model_len, pad_block
            )
            self._capture()

    def _capture(self) -> None:
        graphs = self.graphs
        if not graphs.captured:
            logger.info("decode graph sizes %s: uncaptured on %s", graphs.sizes, self.device)
            return
        try:
            self.capture_seconds = graphs.capture()
        except Exception:  # a failed capture leaves the eager path, which every step can run
            logger.exception("CUDA graph capture failed: decodes run without graphs")
            self.graphs = None
            return
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(graphs.sizes),
            " ".join(map(str, graphs.sizes)),
            self.capture_seconds,
            graphs.capture_bytes / 2**20,
        )

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile now, at start-up, not on the first request: one dummy 2-token forward (the
        graph is dynamic in the token count), then the attention backend's own kernels. Its KV
        lands in block 0, which no request holds yet. Returns the seconds it took."""
        start = time.perf_counter()
        meta = AttentionMetadata(
            slot_mapping=self._tensor([0, 1]),
            query_start_loc=[0, 2],
            seq_lens=[2],
            block_table=self._tensor([0]).view(1, 1),
            seq_lens_tensor=self._tensor([2]),
            num_decodes=0,
            block_size=self.block_size,
            request_ids=["warm-up"],
        )
        input_ids, positions = self._tensor([0, 0]), self._tensor([0, 1])
        rows = positions
        if self.plans is not None:
            self.plans.send(StepPlan(input_ids, positions, meta, rows))
        with forward_context(ForwardContext(meta, self.layers, self.kv_caches)):
            hidden = self.forward(input_ids, positions)
        self.model.compute_logits(hidden[rows])
        layer = next(iter(self.layers.values()))
        layer.backend.warm_up(list(self.kv_caches.values()), layer.num_heads)
        seconds = time.perf_counter() - start
        logger.info("model compiled in %.1f s", seconds)
        return seconds

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], connector_meta: object = None
    ) -> dict[str, SampledToken]:
        if connector_meta is not None:
            self.connector.bind_connector_metadata(connector_meta)
        try:
            return self._execute(scheduled)
        finally:
            if connector_meta is not None:
                self.connector.clear_connector_metadata()

    def _execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, SampledToken]:
        batch = self.prepare(scheduled)
        masks = self.masks and self.masks.start(batch.sample_reqs)  # computed during the forward
        transfers = self.connector is not None and self.connector.has_connector_metadata()
        meta = batch.attn_metadata
        if not transfers and self.graphs is not None and self.graphs.fits(meta):
            hidden = self.graphs.run(batch.input_ids, batch.positions, meta)
        else:
            hidden = self._forward(batch, transfers)
        if not batch.sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if masks is not None:
            self.masks.apply(masks, logits)
        sampled = self.sampler(logits, batch.sample_reqs)
        return {req.request_id: s for req, s in zip(batch.sample_reqs, sampled)}

    def _forward(self, batch: ModelInput, transfers: bool) -> torch.Tensor:
        """The step's hidden states from the model's forward, with the connector's loads and
        saves around it (`transfers`) and the plan sent to the other ranks."""
        ctx = ForwardContext(batch.attn_metadata, self.layers, self.kv_caches, self.connector)
        with forward_context(ctx):
            if transfers:
                self.connector.start_load_kv(ctx)
            if self.plans is not None:
                if transfers:  # the other ranks' heads land before they run
                    self.connector.wait_for_all_loads()
                meta, rows = batch.attn_metadata, batch.logits_indices
                self.plans.send(StepPlan(batch.input_ids, batch.positions, meta, rows))
            hidden = self.forward(batch.input_ids, batch.positions)
            if transfers:
                self.connector.wait_for_save()
        return hidden

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        order = sorted(scheduled, key=lambda rn: rn[1] != 1)  # decodes first, stable
        tokens, positions, slots, tables = [], [], [], []
        starts, seq_lens, logits_idx, sample_reqs = [0], [], [], []
        bs = self.block_size
        for req, num_new in order:
            first = req.num_computed_tokens
            end = first + num_new
            tokens.extend(req.all_token_ids[first:end])
            positions.extend(range(first, end))
            ids = req.block_ids
            slots.extend(ids[p // bs] * bs + p % bs for p in range(first, end))
            tables.append(ids)
            starts.append(starts[-1] + num_new)
            seq_lens.append(end)
            if end == req.num_tokens:
                logits_idx.append(starts[-1] - 1)
                sample_reqs.append(req)
        num_decodes = sum(1 for _, n in order if n == 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_table=self._block_table(tables),
            seq_lens_tensor=self._tensor(seq_lens),
            num_decodes=num_decodes,
            block_size=bs,
            request_ids=[req.request_id for req, _ in order],
        )
        return ModelInput(
            self._tensor(tokens),
            self._tensor(positions),
            meta,
            self._tensor(logits_idx),
            sample_reqs,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _block_table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)
