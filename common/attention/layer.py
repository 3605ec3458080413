"""The attention layer: the model calls `Attention(q, k, v)`, which calls the decorated
`unified_attention(query, key, value, layer_name)`; the backend, the KV cache and the step's
metadata come from the forward context, never from the model.
"""

from __future__ import annotations

import torch
from torch import nn

from common.attention.backends.base import AttentionBackend
from common.attention.context import get_attention_context
from common.attention.decorator import maybe_transfer_kv_layer


class Attention(nn.Module):
    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None  # set by the model runner

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (T, Hq*D), key/value (T, Hkv*D) → (T, Hq*D)."""
        return unified_attention(query, key, value, self.layer_name)


@maybe_transfer_kv_layer
def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    meta, layer, kv_cache = get_attention_context(layer_name)
    assert meta is not None and layer.backend is not None, f"{layer_name}: no metadata or backend"
    num_tokens = query.shape[0]
    out = layer.backend.forward(
        query.view(num_tokens, layer.num_heads, layer.head_dim),
        key.view(num_tokens, layer.num_kv_heads, layer.head_dim),
        value.view(num_tokens, layer.num_kv_heads, layer.head_dim),
        kv_cache,
        meta,
        layer.scale,
        layer.sliding_window,
    )
    return out.reshape(num_tokens, layer.num_heads * layer.head_dim)
