"""The wire a connector moves KV over: `Transport`, what its worker half calls, and nothing more.

A transport owns this worker's registered KV (`layout`: every rank's shards at TP > 1) and the
peers it moves KV with. A peer is added from its `KVLayout` and `metadata()`, both sent in the
handshake (peers.py); a layout the transport cannot serve is refused then. `read_layers` and
`write_layer` move the K and V of runs of blocks (layout.py) and return a `TransferFuture` at
once: it fails with a `TransferError` (a dead or unknown peer) or a `TimeoutError` (past
`deadline`), and tells when the memory it touched is free again (`is_settled`). A transfer's
notification reaches the peer after its data (`get_notifs` there). `via` moves the blocks of a
staging buffer (`register`ed memory laid out as another shard split) instead of the KV.

Implementations: nixl/transport.py (`NixlTransport`, the real wire) and fake.py
(`LoopbackTransport`, tensor copies between engines of one process). Both subclass this
protocol; tests/test_kv_transport_protocol.py checks that their signatures match it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from common.kv_transfer.layout import KVLayout, ShardTensors
from common.kv_transfer.transfers import TransferFuture


class Transport(Protocol):
    layout: KVLayout  # this worker's KV, as peers address it

    # -- peers ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """What a peer needs to connect to this transport (NIXL: the agent's metadata)."""
        ...

    def add_peer(self, layout: KVLayout, metadata: bytes) -> None:
        """Connect to a peer (a no-op for a known one); ValueError if its layout is refused."""
        ...

    def has_peer(self, engine_id: str) -> bool: ...

    def peer_layout(self, engine_id: str) -> KVLayout | None: ...

    def retire_peer(self, engine_id: str) -> None:
        """A peer that will not be used again: forgotten once its transfers have settled."""
        ...

    @property
    def num_peers(self) -> int: ...

    def peer_transports(self) -> dict[str, frozenset[str]]:
        """{peer: what carries its KV (NIXL: UCX's transports, as UCX reported them)}, for the
        peers this transport has moved KV with; reported through the connector's stats."""
        ...

    # -- transfers -----------------------------------------------------------------------------
    def read_layers(
        self,
        peer: str,
        layers: Sequence[int],
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes = b"",
        deadline: float | None = None,
        via: KVLayout | None = None,
    ) -> TransferFuture:
        """Copy the peer's `remote_blocks` of `layers` into our `local_blocks` (K and V)."""
        ...

    def write_layer(
        self,
        peer: str,
        layer: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes = b"",
        deadline: float | None = None,
        ready: Any = None,
        via: KVLayout | None = None,
    ) -> TransferFuture:
        """Copy our `local_blocks` of `layer` to the peer's, after `ready` (a CUDA event)."""
        ...

    def register(self, tensor: torch.Tensor) -> Any:
        """Register more local memory (a staging buffer); its handle for `deregister`."""
        ...

    def deregister(self, registration: Any) -> None: ...

    # -- notifications and the end -------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def get_notifs(self) -> list[bytes]:
        """Notifications received from any peer since the last call."""
        ...

    def close(self) -> None:
        """Fail the transfers still pending and free the registered memory."""
        ...


# (engine id, every rank's KV shards) → the connector's transport, once the KV is registered
MakeTransport = Callable[[str, list[ShardTensors]], Transport]
