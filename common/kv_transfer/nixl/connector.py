"""`NixlConnector`: the `KVConnector` over NIXL, a façade over a scheduler half (scheduler.py:
what each request's KV does, decided between steps) and a worker half (worker.py: the transport
and the KV tensors, inside the forward), as vLLM splits its own NIXL connector. What the two
halves share is made here: the blocks held while a transfer may touch them (`TransferHolds`),
the pushes in flight (`PushTable`) and the running totals (`TransferStats`).
"""

from __future__ import annotations

from common.config import TransferConfig
from common.kv_cache.block_pool import Block, BlockPool
from common.kv_transfer.base import (
    KVConnector,
    KVLoss,
    KVTransferStats,
    PeerInfo,
    Request,
    Reservation,
)
from common.kv_transfer.nixl.holds import TransferHolds
from common.kv_transfer.nixl.push import PushTable
from common.kv_transfer.nixl.scheduler import NixlScheduler
from common.kv_transfer.nixl.stats import TransferStats
from common.kv_transfer.nixl.worker import NixlWorker, StepMeta, nixl_transport
from common.kv_transfer.params import RemotePrefill
from common.kv_transfer.transport import MakeTransport


class NixlConnector(KVConnector):
    def __init__(
        self,
        cfg: TransferConfig,
        block_size: int,
        pool: BlockPool,
        make_transport: MakeTransport = nixl_transport,
    ):
        super().__init__()
        self.holds = TransferHolds(pool)
        self.pushes = PushTable(self.holds, block_size)
        self.stats = TransferStats()
        self.worker = NixlWorker(cfg, self.holds, self.pushes, self.stats, make_transport)
        self.scheduler = NixlScheduler(cfg, block_size, pool, self.worker, self.pushes, self.stats)

    @property
    def transport(self):
        """The worker half's `Transport` (None before `register_kv_caches`), for tests that
        inject faults into it."""
        return self.worker.transport

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, shards: list | None = None) -> None:
        self.worker.register_kv_caches(kv_caches, shards)
        self.scheduler.register_layers(self.worker.num_layers)

    def start_load_kv(self, ctx) -> None:
        self.worker.start_load_kv(self.connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata) -> None:
        self.worker.save_kv_layer(self.connector_metadata, layer_name, kv_cache)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self.connector_metadata)

    def wait_for_all_loads(self) -> None:
        self.worker.wait_for_all_loads()

    # -- scheduler side --------------------------------------------------------------------------
    def num_external_tokens(self, request: Request, num_local_cached: int) -> int:
        return self.scheduler.num_external_tokens(request, num_local_cached)

    def after_allocation(self, request: Request, num_local_cached: int) -> None:
        self.scheduler.after_allocation(request, num_local_cached)

    def build_connector_meta(self, scheduled: list[tuple[Request, int]]) -> StepMeta | None:
        return self.scheduler.build_connector_meta(scheduled)

    def request_finished(self, request: Request) -> bool:
        return self.scheduler.request_finished(request)

    def take_failed(self) -> dict[str, KVLoss]:
        return self.worker.take_failed()

    def is_sending(self, request_id: str) -> bool:
        return self.pushes.is_sending(request_id)

    def take_sent(self) -> dict[str, str | None]:
        return self.pushes.take_settled()

    def reserve(self, num_tokens: int, held: list[Block] | None = None) -> Reservation:
        return self.scheduler.reserve(num_tokens, held)

    def reservation_state(self, reservation_id: str) -> str:
        return self.scheduler.reservation_state(reservation_id)

    def claim_reservation(self, reservation_id: str) -> Reservation:
        return self.scheduler.claim_reservation(reservation_id)

    def verify_pushed(self, remote: RemotePrefill, block_ids: list[int]) -> str | None:
        return self.worker.verify_pushed(remote, block_ids)

    def release_reservation(self, reservation_id: str) -> bool:
        return self.scheduler.release_reservation(reservation_id)

    def release_lease(self, request_id: str) -> bool:
        return self.scheduler.release_lease(request_id)

    def lease_prefix(self, lease_id: str, blocks: list[Block]) -> dict:
        return self.scheduler.lease_prefix(lease_id, blocks)

    def notify_release(self, remote: RemotePrefill) -> None:
        self.worker.notify_release(remote)

    def count_loaded(self, mode: str) -> None:
        self.stats.loaded_requests[mode] += 1

    def count_recomputed(self, reason: str) -> None:
        self.stats.recomputed[reason] += 1

    def poll(self) -> None:
        for msg in self.worker.get_notifs():
            self.scheduler.on_notification(msg)
        self.worker.settle()
        self.scheduler.settle()

    def has_pending(self) -> bool:
        return self.scheduler.has_pending() or self.worker.has_pending()

    def stats_snapshot(self) -> KVTransferStats:
        loads, pushes = self.stats, self.pushes.stats
        leases, reservations = self.scheduler.leases, self.scheduler.reservations
        incomplete = reservations.num_incomplete if reservations is not None else 0
        return KVTransferStats(
            num_loads=loads.num_loads,
            num_load_failures=loads.num_load_failures,
            num_bytes_loaded=loads.num_bytes_loaded,
            seconds_loading=loads.seconds_loading,
            num_load_descriptors=loads.num_load_descriptors,
            num_lease_expiries=leases.num_expired,
            num_bytes_pushed=pushes.num_bytes_pushed,
            seconds_pushing=pushes.seconds_pushing,
            seconds_push_exposed=pushes.seconds_push_exposed,
            num_push_failures=pushes.num_push_failures + incomplete,
            num_checksum_failures=loads.num_checksum_failures,
            num_push_blocks_held=reservations.num_blocks_held if reservations is not None else 0,
            num_blocks_held=leases.num_blocks_held,
            num_blocks_in_transfer=self.holds.num_blocks_held,
            num_blocks_quarantined=self.holds.num_quarantined,
            num_pushes_in_flight=len(self.pushes),
            loaded_requests=dict(loads.loaded_requests),
            recomputed=dict(loads.recomputed),
            descriptors={
                "read": loads.descriptors_a_layer.copy(),
                "write": pushes.descriptors_a_layer.copy(),
            },
            seconds={
                "read": loads.seconds_a_request.copy(),
                "write": pushes.seconds_a_request.copy(),
            },
            peer_transports=self.worker.peer_transports(),
        )

    # -- peers -----------------------------------------------------------------------------------
    def peer_info(self) -> PeerInfo | None:
        return self.worker.peer_info()

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        self.worker.add_peer(layout, metadata)

    def has_peer(self, engine_id: str) -> bool:
        return self.worker.transport.has_peer(engine_id)

    def retire_peer(self, engine_id: str) -> None:
        self.worker.transport.retire_peer(engine_id)

    @property
    def num_peers(self) -> int:
        return 0 if self.worker.transport is None else self.worker.transport.num_peers

    def close(self) -> None:
        self.worker.close()
