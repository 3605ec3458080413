"""Pure-torch paged attention: runs on any device; the reference for other backends.

Decodes (one query each) are batched: their blocks are gathered into a padded (B, L) context
and masked by length. Prefill chunks run one sequence at a time with a bottom-right causal mask
over cached prefix + new tokens; a chunk with no cached prefix attends to its own K/V directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.attention.backends.base import AttentionBackend, write_kv
from common.attention.metadata import AttentionMetadata


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = _decode(query[:nd], kv_cache, meta, scale, sliding_window)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if meta.seq_lens[i] == end - start:  # no cached prefix: attend to the new K/V
                k, v = key[start:end], value[start:end]
            else:
                k, v = _gather_one(kv_cache, meta.block_table[i], meta.seq_lens[i])
            out[start:end] = _prefill(query[start:end], k, v, scale, sliding_window)
        return out


def _gather_one(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int):
    num_blocks = -(-seq_len // kv_cache.shape[2])
    kv = kv_cache[:, block_ids[:num_blocks]]  # (2, nb, bs, H, D)
    kv = kv.flatten(1, 2)[:, :seq_len]  # (2, L, H, D)
    return kv[0], kv[1]


def _prefill(q, k, v, scale, sliding_window):
    """q (Q, Hq, D) are the last Q of L positions; k/v (L, Hkv, D)."""
    num_q, seq_len = q.shape[0], k.shape[0]
    # NOTE: 4-D (1, H, *, D): on CPU a 3-D input takes SDPA's math path, a 4-D one its flash
    # kernel (4.6x faster at 1024 tokens, 1.2-1.4x at 128)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    if num_q == seq_len and sliding_window is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)


def _decode(q, kv_cache, meta: AttentionMetadata, scale, sliding_window):
    """q (B, Hq, D), one query per sequence, at position seq_len - 1."""
    nd = q.shape[0]
    slots, mask = _decode_plan(meta, nd, kv_cache.shape[2], sliding_window)
    heads, dim = kv_cache.shape[3:]
    flat = kv_cache.view(2, -1, heads, dim)
    k = flat[0].index_select(0, slots.view(-1)).view(nd, -1, heads, dim).transpose(1, 2)
    v = flat[1].index_select(0, slots.view(-1)).view(nd, -1, heads, dim).transpose(1, 2)
    # NOTE: each KV head's group of query heads is its "query sequence": (B, Hkv, G, D) over
    # (B, Hkv, L, D), no GQA expansion. In bf16 on CPU this is 6x faster than one query with
    # enable_gqa=True (2.6 ms vs 0.4 ms a layer at batch 32, 160 positions) and bit-identical
    out = F.scaled_dot_product_attention(
        q.view(nd, k.shape[1], -1, dim), k, v, attn_mask=mask, scale=scale
    )
    return out.view(nd, -1, dim)


def _decode_plan(meta: AttentionMetadata, nd: int, block_size: int, sliding_window: int | None):
    """Flat cache slots (B, L) of every decode's context and its mask (B, 1, 1, L) or None;
    computed once per step and shared by all layers."""
    key = ("decode", sliding_window)
    if key not in meta.memo:
        lens = meta.seq_lens_tensor[:nd, None]
        max_len = max(meta.seq_lens[:nd])
        pos = torch.arange(max_len, device=lens.device)[None, :]  # (1, L)
        table = meta.block_table[:nd]
        slots = table.gather(1, (pos // block_size).expand(nd, -1)) * block_size + pos % block_size
        mask = pos < lens
        if sliding_window is not None:
            mask &= pos >= lens - sliding_window
        mask = None if bool(mask.all()) else mask[:, None, None]
        meta.memo[key] = (slots, mask)
    return meta.memo[key]
