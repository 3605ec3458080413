"""The KV connector interface: how KV moves between workers, per layer.

Worker side (runs inside the model forward, called by `maybe_transfer_kv_layer`):
- `bind_connector_metadata(meta)` / `clear_connector_metadata()`: the per-step plan, set by the
  model runner around each forward; `has_connector_metadata()` tells the decorator whether this
  step transfers anything at all.
- `register_kv_caches(kv_caches, shards)`: the paged KV tensors, once, before the first step
  (`shards`: at TP > 1, every rank's, as layout.ShardTensors).
- `start_load_kv(ctx)`: start every read planned for this step, before the first layer runs.
- `wait_for_layer_load(layer_name)`: block until this layer's KV has landed (decode side).
- `save_kv_layer(layer_name, kv_cache, attn_metadata)`: start sending this layer's KV (prefill
  side); must not block the forward on the transfer.
- `wait_for_save()`: after the forward, until every send of this step is under way or done.
- `wait_for_all_loads()`: at TP > 1, before the step's plan reaches the other ranks.

Scheduler side (the engine calls these between steps, on the same thread):
- `num_external_tokens(request, num_local_cached)`: how many of the request's tokens come from
  outside (a remote prefill) beyond its own prefix-cache hits.
- `after_allocation(request, num_local_cached)`: blocks are allocated; plan the load.
- `build_connector_meta(scheduled)`: this step's plan, bound to the worker side by the runner.
- `request_finished(request)`: True when the connector keeps the request's blocks (a prefill
  worker holds them for a remote reader) instead of the scheduler freeing them.
- `take_failed()`: request ids whose KV did not fully arrive (or did not check out) this
  step, each with a `KVLoss` (reason label and message).
- `is_sending(request_id)` / `take_sent()`: a finished request whose KV is still being sent
  (push) keeps its output back until the sends settle; `take_sent()` gives the ids that
  settled since the last call, each with why it failed (None: every byte landed).
- `count_loaded(mode)` / `count_recomputed(reason)`: where each remote-prefill request's KV
  came from, for metrics (`pdserve_kv_loaded_requests_total`, `pdserve_kv_recomputed_total`).
- `poll()`: between steps: notifications, lease expiry; `has_pending()` asks the engine loop to
  keep calling it while idle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.attention.context import ForwardContext
    from common.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class KVLoss:
    """Why a request's remote KV cannot be used: a metric label and a message for the client."""

    reason: str  # read_failed | lease_expired | checksum_mismatch | push_incomplete | ...
    message: str

    def __str__(self) -> str:
        return self.message


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
    def register_kv_caches(  # noqa: B027
        self, kv_caches: dict[str, torch.Tensor], shards: list | None = None
    ) -> None:
        """Called once with every layer's paged KV tensor (and every rank's, at TP > 1)."""

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

    def wait_for_all_loads(self) -> None:  # noqa: B027
        """Every read of this step has landed or failed (TP > 1: before the plan is sent)."""

    # -- scheduler side ----------------------------------------------------------------------
    def num_external_tokens(self, request: Any, num_local_cached: int) -> int:
        return 0

    def after_allocation(self, request: Any, num_local_cached: int) -> None:  # noqa: B027
        """Called once blocks cover the request's tokens."""

    def build_connector_meta(self, scheduled: list) -> Any:
        return None

    def request_finished(self, request: Any) -> bool:
        return False

    def take_failed(self) -> dict[str, KVLoss]:
        return {}

    def is_sending(self, request_id: str) -> bool:
        return False

    def take_sent(self) -> dict[str, str | None]:
        return {}

    def count_loaded(self, mode: str) -> None:  # noqa: B027
        """A remote-prefill request decodes from transferred KV (`pull` or `push`)."""

    def count_recomputed(self, reason: str) -> None:  # noqa: B027
        """A remote-prefill request's prompt is computed locally instead (`KVLoss.reason`)."""

    def poll(self) -> None:  # noqa: B027
        """Between steps: handle notifications and expiries."""

    def has_pending(self) -> bool:
        return False
