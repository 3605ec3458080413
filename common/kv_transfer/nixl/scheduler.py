"""The NIXL connector's scheduler half: between steps, on the engine thread, it decides what
each request's KV does. P: a finished request's blocks go under a lease for the reader (pull)
or its chunks are planned as WRITEs (push); a prompt prefix that a decode worker lent is read
the way D reads (the reverse pull). D: a remote-prefill request's READ is planned once its
blocks are allocated (and refused when its params do not fit), blocks are reserved for a
prefill worker to push into, and a prompt's cached prefix is leased for one to read. It builds
the step's plan (`StepMeta`) that the worker half carries out, and reads the peers'
notifications (a lease released, a push chunk landed).
"""

from __future__ import annotations

import logging

from common.config import TransferConfig
from common.kv_cache.block_pool import Block, BlockPool
from common.kv_transfer.base import Request, Reservation
from common.kv_transfer.nixl.leases import LeaseTable, wall_deadline
from common.kv_transfer.nixl.push import PushTable
from common.kv_transfer.nixl.reservations import PUSHED, ReservationTable
from common.kv_transfer.nixl.stats import TransferStats
from common.kv_transfer.nixl.worker import RELEASE, LoadPlan, NixlWorker, StepMeta
from common.kv_transfer.params import RemotePrefill, push_target, wants_remote_decode

logger = logging.getLogger(__name__)


class NixlScheduler:
    def __init__(
        self,
        cfg: TransferConfig,
        block_size: int,
        pool: BlockPool,
        worker: NixlWorker,
        pushes: PushTable,
        stats: TransferStats,
    ):
        self.cfg = cfg
        self.block_size = block_size
        self.pool = pool
        self.worker = worker
        self.pushes = pushes  # P
        self.stats = stats
        self.leases = LeaseTable(pool.free, cfg.lease_timeout)  # P
        self.reservations: ReservationTable | None = None  # D, once the layers are known
        self._plans: dict[str, LoadPlan] = {}

    def register_layers(self, num_layers: int) -> None:
        self.reservations = ReservationTable(self.pool, num_layers, self.cfg.lease_timeout)

    # -- P: hold blocks for the reader ------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        if not wants_remote_decode(request.kv_transfer_params) or not request.output_token_ids:
            self.pushes.forget(request.request_id)
            return False
        target = push_target(request.kv_transfer_params)
        sent = request.block_ids[target.num_held_blocks :] if target else request.block_ids
        checksums = self.worker.checksums(sent) if self.cfg.kv_checksum else None
        if target is not None:  # pushed: nothing to hold once the writes settle
            self.pushes.finish(request.request_id)
            request.kv_transfer_params_out = self._answer(
                request, [], checksums, push_reservation_id=target.reservation_id
            )
            return False
        if request.is_aborted or not request.blocks:
            return False
        read_by = wall_deadline(self.cfg.lease_timeout)  # before the lease starts: never later
        self.leases.hold(request.request_id, request.blocks)
        request.kv_transfer_params_out = self._answer(
            request, request.block_ids, checksums, read_by=read_by
        )
        request.blocks = []
        return True

    def _answer(self, request: Request, block_ids: list[int], checksums, **fields) -> dict:
        """Where the reader finds the request's KV: the `kv_transfer_params` P answers with."""
        return RemotePrefill(
            remote_engine_id=self.cfg.engine_id,
            remote_block_ids=block_ids,
            remote_request_id=request.request_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self.cfg.advertise_port,
            first_token_id=request.output_token_ids[0],
            kv_checksums=checksums,
            **fields,
        ).to_dict()

    def release_lease(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    # -- D: lend a prompt's prefix to a prefill worker (the reverse pull) ---------------------
    def lease_prefix(self, lease_id: str, blocks: list[Block]) -> dict:
        """Hold `blocks` (referenced by the caller) for P to read; the params it reads with."""
        block_ids = [b.block_id for b in blocks]
        checksums = self.worker.checksums(block_ids) if self.cfg.kv_checksum else None
        read_by = wall_deadline(self.cfg.lease_timeout)
        self.leases.hold(lease_id, blocks)
        return RemotePrefill(
            remote_engine_id=self.cfg.engine_id,
            remote_block_ids=block_ids,
            remote_request_id=lease_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self.cfg.advertise_port,
            kv_checksums=checksums,
            read_by=read_by,
            prefix_only=True,
        ).to_dict()

    # -- between steps ---------------------------------------------------------------------------
    def on_notification(self, msg: bytes) -> None:
        logger.debug("notification %r", msg)
        if msg.startswith(RELEASE):
            self.leases.release(msg[len(RELEASE) :].decode())
        elif msg.startswith(PUSHED):
            try:
                self.reservations.on_notification(msg)
            except ValueError as e:  # a peer of another protocol version: never counts as landed
                logger.warning("ignoring a push notification: %s", e)

    def settle(self) -> None:
        """Pushes whose writes are done report; leases and reservations past their time go."""
        self.pushes.settle()
        for request_id in self.leases.expire():
            logger.warning("lease of %s expired: its blocks are freed", request_id)
        for reservation_id in self.reservations.expire() if self.reservations else []:
            logger.warning("reservation %s expired: its blocks are freed", reservation_id)

    def has_pending(self) -> bool:
        return (
            len(self.leases) > 0
            or bool(self.reservations and len(self.reservations))
            or len(self.pushes) > 0
        )

    # -- D: reservations for pushes ---------------------------------------------------------------
    def reserve(self, num_tokens: int, held: list[Block] | None = None) -> Reservation:
        return self.reservations.reserve(-(-num_tokens // self.block_size), held)

    def reservation_state(self, reservation_id: str) -> str:
        if self.reservations.is_complete(reservation_id):
            return "ready"
        return "pending" if self.reservations.is_known(reservation_id) else "gone"

    def claim_reservation(self, reservation_id: str) -> Reservation:
        return self.reservations.claim(reservation_id)

    def release_reservation(self, reservation_id: str) -> bool:
        return self.reservations.release(reservation_id)

    # -- D: plan reads -----------------------------------------------------------------------------
    def num_external_tokens(self, request: Request, num_local_cached: int) -> int:
        remote = request.remote_prefill
        if remote is None:
            return 0
        if remote.prefix_only:  # P, the reverse pull: D's blocks, at most all but one token
            held = len(remote.remote_block_ids) * self.block_size
            return max(0, min(held, request.num_tokens - 1) - num_local_cached)
        return request.num_tokens - 1 - num_local_cached

    def after_allocation(self, request: Request, num_local_cached: int) -> None:
        remote = request.remote_prefill
        if remote is None:
            return
        request.remote_prefill = None  # loaded once; a later recompute is local
        first = num_local_cached // self.block_size
        last = len(remote.remote_block_ids)
        plan = LoadPlan(
            request.request_id,
            remote,
            request.blocks[first:last],
            remote.remote_block_ids[first:last],
            first_block=first,
            times=request.times,
        )
        self._plans[request.request_id] = plan
        peer = self.worker.peer_layout(remote.remote_engine_id)
        loss = remote.inconsistency(
            request.num_admitted_tokens,  # P's prompt: a resumed request's outputs too
            self.block_size,
            self.worker.num_layers,
            peer and peer.num_blocks,
        )
        if loss is not None:  # fail closed: read nothing, and the step's token is dropped
            self.worker.refuse(plan, loss)

    def build_connector_meta(self, scheduled: list[tuple[Request, int]]) -> StepMeta | None:
        loads = [
            self._plans.pop(req.request_id) for req, _ in scheduled if req.request_id in self._plans
        ]
        pushes = [
            plan
            for req, num_new in scheduled
            if (plan := self.pushes.plan(req, num_new)) is not None
        ]
        for plan in pushes:  # D splits the heads otherwise: written whole from a staging buffer
            plan.staged = self.worker.staged_write(plan)
        return StepMeta(loads, pushes) if loads or pushes else None
