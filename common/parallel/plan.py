"""A step's plan: rank 0 broadcasts it so that every rank runs the same forward.

It holds what the forward needs and nothing more: the input ids and positions, the attention
metadata (slots, query starts, sequence lengths, block table, number of decodes) and the rows
whose logits are sampled. Block ids mean the same on every rank (each holds its heads of every
block), so rank 0's block table serves all of them. The plan is one int64 CPU tensor of fixed
capacity, so a step costs one broadcast; a plan too large for it (a long prefill of many
sequences) follows in a second one.

    header: [command, T, S, W, num_decodes, N, payload length, 0]
    payload: input_ids (T), positions (T), slot_mapping (T), query_start_loc (S + 1),
             seq_lens (S), block_table (S·W), logits_indices (N)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention.metadata import AttentionMetadata
from common.parallel.group import TPGroup

STOP, FORWARD = 0, 1
HEADER = 8
CAPACITY = 4096  # int64s after the header: a decode step of 64 sequences of 1,000 tokens fits
_FOREVER = 365 * 24 * 3600.0  # a rank waits for the next step as long as the engine idles


@dataclass
class StepPlan:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the hidden states whose logits are sampled


class PlanChannel:
    """Rank 0 `send`s each step's plan (and `stop` once); every other rank `receive`s them."""

    def __init__(self, group: TPGroup, device: torch.device, block_size: int):
        self.group = group
        self.device = device
        self.block_size = block_size
        self._buf = torch.zeros(HEADER + CAPACITY, dtype=torch.long)

    def send(self, plan: StepPlan) -> None:
        meta = plan.attn_metadata
        table = meta.block_table
        parts = [
            plan.input_ids,
            plan.positions,
            meta.slot_mapping,
            torch.tensor(meta.query_start_loc, dtype=torch.long),
            meta.seq_lens_tensor,
            table.flatten(),
            plan.logits_indices,
        ]
        payload = torch.cat([p.cpu() for p in parts])
        header = [FORWARD, meta.num_tokens, meta.num_seqs, table.shape[1], meta.num_decodes]
        self._send(header + [plan.logits_indices.numel(), payload.numel(), 0], payload)

    def stop(self, timeout: float | None = None) -> None:
        self._send([STOP] + [0] * (HEADER - 1), None, timeout)

    def _send(self, header: list[int], payload, timeout: float | None = None) -> None:
        buf = self._buf
        buf[:HEADER] = torch.tensor(header)
        fits = payload is None or payload.numel() <= CAPACITY
        if payload is not None and fits:
            buf[HEADER : HEADER + payload.numel()] = payload
        self.group.broadcast_(buf, timeout)
        if not fits:
            self.group.broadcast_(payload, timeout)

    def receive(self) -> StepPlan | None:
        """The next step's plan; None when rank 0 says stop."""
        buf = self.group.broadcast_(self._buf, _FOREVER)
        command, num_tokens, num_seqs, width, num_decodes, num_logits, size, _ = buf[
            :HEADER
        ].tolist()
        if command == STOP:
            return None
        if size <= CAPACITY:
            payload = buf[HEADER : HEADER + size]
        else:
            payload = self.group.broadcast_(torch.empty(size, dtype=torch.long))
        payload = payload.to(self.device)
        t, s = num_tokens, num_seqs
        ids, pos, slots, starts, lens, table, logits = payload.split(
            [t, t, t, s + 1, s, s * width, num_logits]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts.tolist(),
            seq_lens=lens.tolist(),
            block_table=table.view(s, width),
            seq_lens_tensor=lens,
            num_decodes=num_decodes,
            block_size=self.block_size,
            request_ids=[""] * s,
        )
        return StepPlan(ids, pos, meta, logits)
