"""The KV connector interface: how KV moves between workers, per layer. This class is the whole
contract: the engine, its scheduler, the model runner, the attention decorator, the HTTP routes
and `RemotePrefills` use nothing of a connector that is not declared here.

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
- Push reservations (D): `reserve(num_tokens, held)` blocks for a prefill worker to write into,
  led by `held`, cached blocks of the prompt that P does not write; `reservation_state(id)`
  ("ready", "pending" or "gone"); `claim_reservation(id)` takes a ready one (its blocks);
  `verify_pushed(remote, block_ids)` checks the written ones against P's checksums;
  `release_reservation(id)` gives one up.
- Leases (P): `release_lease(request_id)` frees blocks held for a reader that gave up;
  `notify_release(remote)` (D) tells the prefill worker so, for a request it will not read.
- The reverse pull (D): `lease_prefix(lease_id, blocks)` holds a prompt's cached leading blocks
  (already referenced) under a lease for a prefill worker to read, and answers the
  `kv_transfer_params` (`prefix_only`) it reads them with; the lease ends like P's (the reader's
  release, `release_lease`, expiry). P reads them as D reads a prompt, and computes the rest.
- `count_loaded(mode)` / `count_recomputed(reason)`: where each remote-prefill request's KV
  came from, for metrics (`pdserve_kv_loaded_requests_total`, `pdserve_kv_recomputed_total`).
- `stats_snapshot()`: the connector's running totals as a frozen `KVTransferStats`, with what
  its transport reports of each peer: /metrics reads the transport's facts there, nowhere else.
- `poll()`: between steps: notifications, lease expiry; `has_pending()` asks the engine loop to
  keep calling it while idle.

Peers (`peers.Peers` meets them on the event loop, handshake and all, and adds and retires
them on the engine thread; the HTTP routes serve `peer_info` and count `num_peers`):
- `peer_info()`: what a peer needs to move KV with this worker (None: nothing to connect to).
- `add_peer(layout, metadata)` / `has_peer(engine_id)` / `retire_peer(engine_id)` /
  `num_peers`: the workers this one moves KV with; `close()` ends every transfer.

A connector that moves nothing (the base class's defaults) holds no leases, takes no pushes and
knows no peers: its reservations are all "gone" and its stats all zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.kv_transfer.params import KVLoss, RemotePrefill
from common.kv_transfer.transfers import DescriptorHistogram, SecondsHistogram
from common.tracing import RequestTimes

if TYPE_CHECKING:
    from common.attention.context import ForwardContext
    from common.attention.metadata import AttentionMetadata
    from common.kv_cache.block_pool import Block

__all__ = ["KVConnector", "KVLoss", "KVTransferStats", "PeerInfo", "Request", "Reservation"]


class Request(Protocol):
    """What a connector reads and writes of a request (common/engine/request.py's `Request`)."""

    request_id: str
    kv_transfer_params: dict | None  # as the client sent them
    kv_transfer_params_out: dict | None  # P: where the request's KV is held, for the reader
    remote_prefill: RemotePrefill | None  # D: where the prompt's KV is
    blocks: list[Block]
    output_token_ids: list[int]
    num_computed_tokens: int
    num_admitted_tokens: int  # D: the tokens a prefill worker computed (prompt, resumed outputs)
    times: RequestTimes  # the connector records when its transfer ran (`kv_transfer_ns`)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...

    @property
    def is_aborted(self) -> bool: ...


@dataclass(frozen=True)
class KVTransferStats:
    """A connector's running totals, read after each step (engine/stats.py, then /metrics)."""

    num_loads: int = 0  # D: pull reads, one per request
    num_load_failures: int = 0
    num_bytes_loaded: int = 0
    seconds_loading: float = 0.0
    num_load_descriptors: int = 0
    num_lease_expiries: int = 0  # P
    num_bytes_pushed: int = 0  # P
    seconds_pushing: float = 0.0
    seconds_push_exposed: float = 0.0  # push time the request's answer waited for
    num_push_failures: int = 0  # P's failed writes and D's reservations that never completed
    num_checksum_failures: int = 0
    num_push_blocks_held: int = 0  # D: reserved blocks it held already, which P did not write
    num_blocks_held: int = 0  # P: under a lease for a reader
    num_blocks_in_transfer: int = 0
    num_blocks_quarantined: int = 0  # a failed transfer may still touch them
    num_pushes_in_flight: int = 0  # P: push requests whose writes have not settled
    loaded_requests: dict[str, int] = field(default_factory=dict)  # pull, push (D); reverse (P)
    recomputed: dict[str, int] = field(default_factory=dict)  # by KVLoss.reason
    descriptors: dict[str, DescriptorHistogram] = field(default_factory=dict)  # read | write
    seconds: dict[str, SecondsHistogram] = field(default_factory=dict)  # read | write, a request
    # peer → what carries its KV, as the transport reports it (NIXL: UCX's transports)
    peer_transports: dict[str, frozenset[str]] = field(default_factory=dict)


@dataclass
class Reservation:
    """D: blocks reserved for a prefill worker to push a prompt's KV into (`reserve`), and
    which of its (layer, chunk) writes have landed."""

    reservation_id: str
    blocks: list[Block]
    expires_at: float
    write_by: float  # unix time: P's writes must have landed by then
    landed: set[tuple[int, int]] = field(default_factory=set)  # (layer, chunk)
    num_chunks: int | None = None  # known once a final chunk has reported
    num_held: int = 0  # leading blocks from this worker's own prefix cache: P writes the rest


@dataclass(frozen=True)
class PeerInfo:
    """What a peer needs to move KV with this connector: its KV layout (layout.KVLayout as a
    dict) and the transport's connection metadata (NIXL: the agent's)."""

    layout: dict
    metadata: bytes


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
    def num_external_tokens(self, request: Request, num_local_cached: int) -> int:
        return 0

    def after_allocation(self, request: Request, num_local_cached: int) -> None:  # noqa: B027
        """Called once blocks cover the request's tokens."""

    def build_connector_meta(self, scheduled: list[tuple[Request, int]]) -> Any:
        return None

    def request_finished(self, request: Request) -> bool:
        return False

    def take_failed(self) -> dict[str, KVLoss]:
        return {}

    def is_sending(self, request_id: str) -> bool:
        return False

    def take_sent(self) -> dict[str, str | None]:
        return {}

    # -- D: push reservations ----------------------------------------------------------------
    def reserve(self, num_tokens: int, held: list[Block] | None = None) -> Reservation:
        raise NotImplementedError(f"{type(self).__name__} takes no pushes")

    def reservation_state(self, reservation_id: str) -> str:
        """ "ready" (every write landed), "pending" or "gone" (expired, released or unknown)."""
        return "gone"

    def claim_reservation(self, reservation_id: str) -> Reservation:
        """A ready reservation, its blocks now the caller's."""
        raise KeyError(reservation_id)

    def verify_pushed(self, remote: RemotePrefill, block_ids: list[int]) -> str | None:
        """Why pushed blocks differ from the prefill worker's checksums, or None."""
        return None

    def release_reservation(self, reservation_id: str) -> bool:
        return False

    # -- leases ------------------------------------------------------------------------------
    def release_lease(self, request_id: str) -> bool:
        """P: free the blocks held for a reader of `request_id`; False if none are."""
        return False

    def lease_prefix(self, lease_id: str, blocks: list[Block]) -> dict:
        """D: hold `blocks` for a prefill worker to read (the reverse pull); its params."""
        raise NotImplementedError(f"{type(self).__name__} lends no KV")

    def notify_release(self, remote: RemotePrefill) -> None:  # noqa: B027
        """D: tell the prefill worker it may free a request's blocks (also for requests D will
        not read)."""

    # -- accounting ----------------------------------------------------------------------------
    def count_loaded(self, mode: str) -> None:  # noqa: B027
        """A remote-prefill request decodes from transferred KV (`pull` or `push`)."""

    def count_recomputed(self, reason: str) -> None:  # noqa: B027
        """A remote-prefill request's prompt is computed locally instead (`KVLoss.reason`)."""

    def stats_snapshot(self) -> KVTransferStats:
        return KVTransferStats()

    def poll(self) -> None:  # noqa: B027
        """Between steps: handle notifications and expiries."""

    def has_pending(self) -> bool:
        return False

    # -- peers ---------------------------------------------------------------------------------
    def peer_info(self) -> PeerInfo | None:
        return None

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no peers")

    def has_peer(self, engine_id: str) -> bool:
        return False

    def retire_peer(self, engine_id: str) -> None:  # noqa: B027
        """A peer that will not be used again (its worker restarted): forget it once its
        transfers have settled."""

    @property
    def num_peers(self) -> int:
        return 0

    def close(self) -> None:  # noqa: B027
        """Fail transfers still in flight and free the transport."""
