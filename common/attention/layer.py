"""The attention layer: the model calls `Attention(q, k, v)`, which calls the decorated
`unified_attention(query, key, value, layer_name)`; the backend, the KV cache and the step's
metadata come from the forward context, never from the model.

Under torch.compile the call goes through the custom op `pdserve::unified_attention`, so the
compiled graph holds one opaque node per layer and the decorator (KV transfer) still runs in
Python, per layer, at run time. A compiled graph may pad the batch: rows past the step's
`num_tokens` are neither written to the cache nor attended; their output is zero.
"""

from __future__ import annotations

import torch
from torch import nn

from common.attention.backends.base import AttentionBackend
from common.attention.context import get_attention_context, get_forward_context
from common.attention.decorator import maybe_transfer_kv_layer


class Attention(nn.Module):
    def __init__(
        self,
        layer_name: str,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.layer_name = layer_name
        self.layer_index = layer_index
        # the index as a CPU tensor: a graph input, not a constant, so that every layer can run
        # one compiled graph (set by the compiled path: a tensor made here could land on "meta")
        self.index_tensor: torch.Tensor | None = None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None  # set by the model runner

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (T, Hq*D), key/value (T, Hkv*D) → (T, Hq*D)."""
        if torch.compiler.is_compiling():
            return torch.ops.pdserve.unified_attention(query, key, value, self.index_tensor)
        return unified_attention(query, key, value, self.layer_name)


@maybe_transfer_kv_layer
def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    meta, layer, kv_cache = get_attention_context(layer_name)
    assert meta is not None and layer.backend is not None, f"{layer_name}: no metadata or backend"
    num_padded, num_tokens = query.shape[0], meta.num_tokens
    out = layer.backend.forward(
        query[:num_tokens].view(num_tokens, layer.num_heads, layer.head_dim),
        key[:num_tokens].view(num_tokens, layer.num_kv_heads, layer.head_dim),
        value[:num_tokens].view(num_tokens, layer.num_kv_heads, layer.head_dim),
        kv_cache,
        meta,
        layer.scale,
        layer.sliding_window,
    ).reshape(num_tokens, -1)
    if num_padded == num_tokens:
        return out
    return torch.cat([out, out.new_zeros(num_padded - num_tokens, out.shape[1])])


@torch.library.custom_op("pdserve::unified_attention", mutates_args=())
def _unified_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: torch.Tensor
) -> torch.Tensor:
    # NOTE: the KV cache is written through the forward context, not an argument: the op is
    # opaque to the compiler, and its data dependence on the previous layer keeps the order
    layer_name = get_forward_context().layer_names[int(layer_index)]
    return unified_attention(query, key, value, layer_name)


@_unified_attention_op.register_fake
def _(query, key, value, layer_index):
    return torch.empty_like(query)
