"""The scoped forward context: what attention layers read during one model forward.

`forward_context(...)` is a context manager that refuses nesting and always resets, so no
layer can see a stale step's metadata. `get_attention_context(layer_name)` is the one way the
attention path (and the KV-transfer decorator) reaches the step's data.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from common.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from common.attention.backends.base import AttentionBackend


class AttentionLayer(Protocol):
    """What the attention path reads of a layer (common/attention/layer.py's `Attention`):
    declared here so that the context does not import the layer that imports it."""

    backend: AttentionBackend | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


class LayerTransfer(Protocol):
    """What the forward needs of a KV connector (common/kv_transfer/base.py), layer by layer:
    declared here so that attention does not import the connector that imports it."""

    def has_connector_metadata(self) -> bool: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> None: ...


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    layers: dict[str, AttentionLayer]
    kv_caches: dict[str, torch.Tensor]
    connector: LayerTransfer | None = None
    extra: dict = field(default_factory=dict)
    layer_names: list[str] = field(init=False)  # by layer index

    def __post_init__(self) -> None:
        self.layer_names = list(self.layers)


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext | None:
    return _current


def get_attention_context(
    layer_name: str,
) -> tuple[AttentionMetadata | None, AttentionLayer, torch.Tensor]:
    """(attn_metadata, attn_layer, kv_cache) of `layer_name` in the current forward."""
    ctx = _current
    if ctx is None:
        raise RuntimeError(f"attention {layer_name!r} called outside a forward context")
    return ctx.attn_metadata, ctx.layers[layer_name], ctx.kv_caches[layer_name]
