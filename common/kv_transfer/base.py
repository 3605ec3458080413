"""The KV connector interface: how KV moves between workers, per layer.

Worker side (runs inside the model forward, called by `maybe_transfer_kv_layer`):
- `bind_connector_metadata(meta)` / `clear_connector_metadata()`: the per-step plan, set by the
  model runner around each forward; `has_connector_metadata()` tells the decorator whether this
  step transfers anything at all.
- `register_kv_caches(kv_caches)`: the paged KV tensors, once, before the first step.
- `start_load_kv(ctx)`: start every read planned for this step, before the first layer runs.
- `wait_for_layer_load(layer_name)`: block until this layer's KV has landed (decode side).
- `save_kv_layer(layer_name, kv_cache, attn_metadata)`: start sending this layer's KV (prefill
  side); must not block the forward on the transfer.
- `wait_for_save()`: after the forward, until every send of this step is under way or done.
- `get_finished(finished_req_ids)`: request ids whose sends / receives completed.

Scheduler side (how many tokens come from outside, what to do after allocation, per-step
metadata, request completion) joins this class with the NIXL connector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.attention.context import ForwardContext
    from common.attention.metadata import AttentionMetadata


class KVConnector(ABC):
    def __init__(self) -> None:
        self._metadata: Any = None

    # -- per-step metadata ----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def has_connector_metadata(self) -> bool:
        return self._metadata is not None

    @property
    def connector_metadata(self) -> Any:
        return self._metadata

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Called once with every layer's paged KV tensor."""

    @abstractmethod
    def start_load_kv(self, ctx: ForwardContext) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids since the last call."""
        return set(), set()
