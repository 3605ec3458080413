"""`FakeConnector`: KV moves between engines of one process by tensor copies, no NIXL.

It is the NIXL connector with its wire replaced, as vLLM tests its NIXL connector over a
`FakeNixlWrapper`: the scheduler and worker halves (nixl/), so leases, reservations, push
chunks, checksums and the failure policy are the real ones, over a `LoopbackTransport` that
copies blocks between the engines' KV tensors at once (same process, same thread). It is how
P/D semantics are tested in-process (tests/test_pd_inprocess.py); the real wire has its own
tests. A `Loopback` is the fabric: connectors built on the same one reach each other.

Faults (`LoopbackTransport.faults`): the next reads fail (a dead peer), or land with one value
changed (what a checksum catches). A lease or reservation running out needs no fault: a short
`lease_timeout` and the clock do it, as on the wire, where a transfer never runs past its peer's
deadline either.

TP = 1 on both sides only (no staging buffers, no head-sliced transfers).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.config import TransferConfig
from common.kv_cache.block_pool import BlockPool
from common.kv_transfer.layout import KVLayout, ShardTensors, runs
from common.kv_transfer.nixl.connector import NixlConnector
from common.kv_transfer.transfers import TransferError, TransferFuture, TransferResult
from common.kv_transfer.transport import Transport


class Loopback:
    """The transports of this process's engines, by engine id."""

    def __init__(self) -> None:
        self.transports: dict[str, LoopbackTransport] = {}

    def transport(self, engine_id: str, shards: list[ShardTensors]) -> LoopbackTransport:
        return LoopbackTransport(self, engine_id, shards)


@dataclass
class Faults:
    num_failed_reads: int = 0  # the next reads fail with TransferError, nothing lands
    num_corrupt_reads: int = 0  # the next reads land with one K value changed


class LoopbackTransport(Transport):
    """The `Transport`, moving bytes by `copy_` between engines of this process."""

    def __init__(self, fabric: Loopback, engine_id: str, shards: list[ShardTensors]):
        assert len(shards) == 1, "the loopback transport moves KV between TP = 1 engines only"
        self.fabric = fabric
        self.engine_id = engine_id
        self.kv_caches = shards[0].kv_caches  # per layer (2, num_blocks, block_size, H, D)
        self.layout = KVLayout.of(engine_id, f"{engine_id}-loopback", shards)
        self.faults = Faults()
        self._peers: dict[str, KVLayout] = {}
        self._inbox: list[bytes] = []
        fabric.transports[engine_id] = self

    # -- peers ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.engine_id.encode()

    def add_peer(self, layout: KVLayout, metadata: bytes) -> None:
        self.layout.check_peer(layout)  # what NIXL's transport refuses, this refuses
        if metadata.decode() not in self.fabric.transports:
            raise ValueError(f"no engine {metadata.decode()!r} on this loopback")
        self._peers[layout.engine_id] = layout

    def has_peer(self, engine_id: str) -> bool:
        return engine_id in self._peers

    def peer_layout(self, engine_id: str) -> KVLayout | None:
        return self._peers.get(engine_id)

    def retire_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def peer_transports(self) -> dict[str, frozenset[str]]:
        return {}  # no UCX underneath: nothing to report

    def register(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError("no staging on the loopback")

    def deregister(self, registration: Any) -> None:
        raise NotImplementedError("no staging on the loopback")

    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer in self.fabric.transports:  # a peer gone: lost, as over the wire
            self.fabric.transports[peer]._inbox.append(msg)

    def get_notifs(self) -> list[bytes]:
        msgs, self._inbox = self._inbox, []
        return msgs

    def close(self) -> None:
        self.fabric.transports.pop(self.engine_id, None)

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
        assert via is None, "no staging on the loopback"
        if self.faults.num_failed_reads:
            self.faults.num_failed_reads -= 1
            return _failed(TransferError(f"READ from {peer} failed (injected)"))
        future = self._copy(peer, layers, local_blocks, remote_blocks, deadline, is_read=True)
        if self.faults.num_corrupt_reads and future.exception() is None:
            self.faults.num_corrupt_reads -= 1
            self.kv_caches[layers[0]][0, local_blocks[0], 0, 0, 0] += 1.0
        if notif:
            self.send_notif(peer, notif)
        return future

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
        assert via is None, "no staging on the loopback"
        future = self._copy(peer, [layer], local_blocks, remote_blocks, deadline, is_read=False)
        if notif and future.exception() is None:  # a notification comes after its data
            self.send_notif(peer, notif)
        return future

    def _copy(self, peer, layers, local_blocks, remote_blocks, deadline, is_read: bool):
        if deadline is not None and time.monotonic() > deadline:
            return _failed(TimeoutError(f"transfer with {peer}: deadline passed while queued"))
        theirs = self.fabric.transports.get(peer)
        if peer not in self._peers or theirs is None:
            return _failed(TransferError(f"peer {peer!r} is unknown or gone"))
        here, there = torch.tensor(list(local_blocks)), torch.tensor(list(remote_blocks))
        num_bytes = 0
        for layer in layers:
            ours, peers = self.kv_caches[layer], theirs.kv_caches[layer]
            if is_read:
                ours[:, here] = peers[:, there]
            else:
                peers[:, there] = ours[:, here]
            num_bytes += ours[:, here].numel() * ours.element_size()
        num_descriptors = 2 * len(runs(local_blocks, remote_blocks)) * len(layers)
        future = TransferFuture()
        future.set_running_or_notify_cancel()
        future.mark_settled()
        future.set_result(TransferResult(num_bytes, 0.0, num_descriptors))
        return future


def _failed(exc: BaseException) -> TransferFuture:
    future = TransferFuture()
    future.set_running_or_notify_cancel()
    future.mark_settled()  # nothing was touched
    future.set_exception(exc)
    return future


class FakeConnector(NixlConnector):
    """The NIXL connector over `fabric` instead of NIXL."""

    def __init__(self, cfg: TransferConfig, block_size: int, pool: BlockPool, fabric: Loopback):
        super().__init__(cfg, block_size, pool, make_transport=fabric.transport)

    @property
    def faults(self) -> Faults:
        return self.worker.transport.faults
