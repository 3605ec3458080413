"""The NIXL connector: pull-mode KV transfer between a prefill (P) and a decode (D) worker.

P (`do_remote_decode`): the request prefills and samples its first token as usual; when it
finishes, its blocks go under a lease instead of back to the pool, and its output carries
`kv_transfer_params` saying where they are (`RemotePrefill`).

D (`do_remote_prefill`): on admission the request counts every prompt token it lacks as computed
elsewhere, so it is scheduled for a single token (the one after the prompt, or the last prompt
token when no first token came along). Its blocks are allocated, its own prefix hits skipped;
`start_load_kv` issues one NIXL READ of every layer for the rest (its blocks' runs, not blocks,
are the descriptors: docs/design.md), and the forward's decorator waits for it just before the
first layer's attention and checks each layer's checksums before that layer's. After the forward
D tells P to release the lease. A read that fails or passes `load_timeout` marks the request
failed: the engine drops its token and recomputes it locally or fails it, by policy.

Push (layer-wise): D first reserves blocks (`reserve`); P, given the reservation as `push_to`,
WRITEs each layer's blocks from `save_kv_layer` — right after that layer's attention, while the
next layer computes. Each prefill step sends one chunk (the blocks that became full, all of them
in the last step); every chunk's WRITE of every layer carries a notification, and D admits the
request only once every chunk of every layer has landed (see reservations.py). P's step never
waits for its writes: the request's output waits (`is_sending`), and P answers with the
reservation only when every write landed, with an error otherwise.

Fail closed: blocks that a transfer reads or writes stay referenced until the transfer settles
(`TransferHolds`), so a failed, aborted or finished request never lets a late READ land in, or
a late WRITE read from, blocks that another request owns by then.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import Future

from common.config import TransferConfig
from common.kv_transfer.base import KVConnector, KVLoss, KVTransferStats, PeerInfo, Request
from common.kv_transfer.checksum import mismatch, request_checksums
from common.kv_transfer.holds import TransferHolds
from common.kv_transfer.leases import LeaseTable, wall_deadline
from common.kv_transfer.params import RemotePrefill, push_target, wants_remote_decode
from common.kv_transfer.push import PushTable
from common.kv_transfer.reservations import PUSHED, Reservation, ReservationTable, push_notif
from common.kv_transfer.step import LoadPlan, StepMeta
from common.kv_transfer.transfers import TransferStats, fenced, kv_written_event, submit

logger = logging.getLogger(__name__)

RELEASE = b"release:"


class NixlConnector(KVConnector):
    def __init__(self, cfg: TransferConfig, block_size: int, pool):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.leases = LeaseTable(pool.free, cfg.lease_timeout)
        self.pool = pool
        self.reservations: ReservationTable | None = None  # set once the layers are known
        self.holds = TransferHolds(pool)
        self.pushes = PushTable(self.holds, block_size)  # P
        self.transport = None
        self.kv_caches: list = []  # per layer: its shards holding each head once (checksums)
        self.tp_size = 1
        self._unwritten: int | None = None  # TP push: the layer whose WRITEs wait (save_kv_layer)
        self.layer_index: dict[str, int] = {}
        self.stats = TransferStats()
        self._plans: dict[str, LoadPlan] = {}
        self._futures: dict[int, list[tuple[LoadPlan, Future]]] = defaultdict(list)
        self._failed: dict[str, KVLoss] = {}  # request id → why its load failed

    # -- set-up and peers -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, shards: list | None = None) -> None:
        from common.kv_transfer.layout import ShardTensors, distinct_heads
        from common.kv_transfer.nixl_transport import NixlTransport
        from common.kv_transfer.staging import StagingPool

        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        shards = shards or [ShardTensors(0, list(kv_caches.values()))]
        self.tp_size = len(shards)
        distinct = distinct_heads(shards)
        self.kv_caches = [[s.kv_caches[layer] for s in distinct] for layer in range(len(kv_caches))]
        self.transport = NixlTransport(self.cfg.engine_id, shards)
        self.staging = StagingPool(self.transport, shards)
        self.reservations = ReservationTable(self.pool, len(kv_caches), self.cfg.lease_timeout)

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        from common.kv_transfer.nixl_transport import KVLayout

        self.transport.add_peer(KVLayout.from_dict(layout), metadata)

    def has_peer(self, engine_id: str) -> bool:
        return self.transport.has_peer(engine_id)

    def peer_info(self) -> PeerInfo | None:
        if self.transport is None:  # no KV registered yet
            return None
        return PeerInfo(self.transport.layout.to_dict(), self.transport.metadata())

    def retire_peer(self, engine_id: str) -> None:
        self.transport.retire_peer(engine_id)

    @property
    def num_peers(self) -> int:
        return 0 if self.transport is None else self.transport.num_peers

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- P: hold blocks for the reader ------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        if not wants_remote_decode(request.kv_transfer_params) or not request.output_token_ids:
            self.pushes.forget(request.request_id)
            return False
        target = push_target(request.kv_transfer_params)
        checksums = (
            request_checksums(self.kv_caches, request.block_ids) if self.cfg.kv_checksum else None
        )
        if target is not None:  # pushed: nothing to hold once the writes settle
            self.pushes.finish(request.request_id)
            request.kv_transfer_params_out = RemotePrefill(
                remote_engine_id=self.cfg.engine_id,
                remote_block_ids=[],
                remote_request_id=request.request_id,
                remote_host=self.cfg.advertise_host,
                remote_port=self.cfg.advertise_port,
                first_token_id=request.output_token_ids[0],
                push_reservation_id=target.reservation_id,
                kv_checksums=checksums,
            ).to_dict()
            return False
        if request.is_aborted or not request.blocks:
            return False
        read_by = wall_deadline(self.cfg.lease_timeout)  # before the lease starts: never later
        self.leases.hold(request.request_id, request.blocks)
        request.kv_transfer_params_out = RemotePrefill(
            remote_engine_id=self.cfg.engine_id,
            remote_block_ids=request.block_ids,
            remote_request_id=request.request_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self.cfg.advertise_port,
            first_token_id=request.output_token_ids[0],
            kv_checksums=checksums,
            read_by=read_by,
        ).to_dict()
        request.blocks = []
        return True

    def release_lease(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    def poll(self) -> None:
        for msg in self.transport.get_notifs() if self.transport else []:
            logger.debug("notification %r", msg)
            if msg.startswith(RELEASE):
                self.leases.release(msg[len(RELEASE) :].decode())
            elif msg.startswith(PUSHED):
                self._on_pushed(msg)
        self.holds.settle()
        self.pushes.settle()
        self.staging.settle()
        for request_id in self.leases.expire():
            logger.warning("lease of %s expired: its blocks are freed", request_id)
        for reservation_id in self.reservations.expire() if self.reservations else []:
            logger.warning("reservation %s expired: its blocks are freed", reservation_id)

    def has_pending(self) -> bool:
        return (
            len(self.leases) > 0
            or bool(self.reservations and len(self.reservations))
            or len(self.holds) > 0
            or len(self.pushes) > 0
            or len(self.staging) > 0
        )

    def _on_pushed(self, msg: bytes) -> None:
        try:
            self.reservations.on_notification(msg)
        except ValueError as e:  # a peer of another protocol version: never counts as landed
            logger.warning("ignoring a push notification: %s", e)

    # -- D: reservations for pushes ---------------------------------------------------------------
    def reserve(self, num_tokens: int) -> Reservation:
        return self.reservations.reserve(-(-num_tokens // self.block_size))

    def reservation_state(self, reservation_id: str) -> str:
        """ "ready", "pending" or "gone" (expired, released or never made)."""
        if self.reservations.is_complete(reservation_id):
            return "ready"
        return "pending" if self.reservations.is_known(reservation_id) else "gone"

    def claim_reservation(self, reservation_id: str) -> list:
        return self.reservations.claim(reservation_id)

    def release_reservation(self, reservation_id: str) -> bool:
        return self.reservations.release(reservation_id)

    # -- D: plan, start and wait for reads -----------------------------------------------------
    def num_external_tokens(self, request: Request, num_local_cached: int) -> int:
        if request.remote_prefill is None:
            return 0
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
        )
        self._plans[request.request_id] = plan
        peer = self.transport.peer_layout(remote.remote_engine_id)
        loss = remote.inconsistency(
            request.num_prompt_tokens,
            self.block_size,
            len(self.layer_index),
            peer and peer.num_blocks,
        )
        if loss is not None:  # fail closed: read nothing, and the step's token is dropped
            logger.warning("KV load for %s refused: %s", request.request_id, loss)
            plan.failed = True
            self._failed[request.request_id] = loss

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
            peer = self.transport.peer_layout(plan.target.engine_id)
            plan.staged = peer and self.staging.for_write(peer, len(plan.remote_blocks))
        return StepMeta(loads, pushes) if loads or pushes else None

    def start_load_kv(self, ctx) -> None:
        deadline = time.monotonic() + self.cfg.load_timeout
        for plan in self.connector_metadata.loads:
            plan.started_at = time.perf_counter()
            if plan.failed or not plan.blocks:  # refused, or a full local prefix hit
                continue
            plan.group = self.holds.hold(plan.blocks)
            peer = self.transport.peer_layout(plan.remote.remote_engine_id)
            plan.staged = peer and self.staging.for_read(peer, len(plan.blocks))
            staged = plan.staged
            future = submit(
                self.transport.read_layers,
                plan.remote.remote_engine_id,
                range(len(self.layer_index)),
                range(len(plan.blocks)) if staged else plan.local_blocks,
                plan.remote_blocks,
                deadline=fenced(deadline, plan.remote.read_by),
                via=staged.layout if staged else None,
            )
            if staged:
                staged.futures.append(future)
            plan.group.futures.append(future)
            for layer in range(len(self.layer_index)):
                self._futures[layer].append((plan, future))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """D: block until the READs of this layer are DONE (or failed). NOTE: on CUDA this is
        also what orders them before compute: the layer's attention is launched only after."""
        layer = self.layer_index[layer_name]
        for plan, future in self._futures.pop(layer, []):
            if plan.failed:
                continue
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 — any failed read fails the request
                self._fail_load(plan, "read_failed", f"KV read failed: {e!r}")
                continue
            if plan.remote.read_by is not None and time.time() > plan.remote.read_by:
                # P may have freed and reused the blocks while this read was in flight
                why = "the prefill worker's lease ran out before the KV landed"
                self._fail_load(plan, "lease_expired", why)
                continue
            if plan.staged:  # the peer's blocks landed whole: our heads of them into ours
                plan.staged.scatter(layer, self.staging.shards, plan.local_blocks)
            expected = plan.remote.kv_checksums
            if expected is not None:
                n = len(plan.local_blocks)
                want = expected[layer][plan.first_block : plan.first_block + n]
                why = mismatch(self.kv_caches[layer], plan.local_blocks, want, layer)
                if why is not None:
                    self.stats.num_checksum_failures += 1
                    self._fail_load(plan, "checksum_mismatch", why)

    def _fail_load(self, plan: LoadPlan, reason: str, why: str) -> None:
        """Fail the request's load; reads of it not started yet are cancelled, the rest settle
        into its blocks, which stay held (quarantined once the engine lets them go)."""
        logger.warning("KV load for %s failed: %s", plan.request_id, why)
        plan.failed = True
        self._failed[plan.request_id] = KVLoss(reason, why)
        for future in plan.group.futures:
            future.cancel()

    def verify_pushed(self, remote: RemotePrefill, block_ids: list[int]) -> str | None:
        """D, push mode: why the pushed blocks differ from P's checksums, or None (also where
        the checksums are not one list per layer, each of as many blocks, at most ours)."""
        sums = remote.kv_checksums or []
        if sums and (
            len(sums) != len(self.kv_caches)
            or len({len(c) for c in sums}) != 1
            or len(sums[0]) > len(block_ids)
        ):
            shape = f"{len(sums)} layers of {sorted({len(c) for c in sums})} blocks"
            return f"kv_checksums for {shape}, not {len(self.kv_caches)} of {len(block_ids)}"
        for layer, expected in enumerate(sums):
            why = mismatch(self.kv_caches[layer], block_ids[: len(expected)], expected, layer)
            if why is not None:
                self.stats.num_checksum_failures += 1
                return why
        return None

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata) -> None:
        """P, push mode: WRITE this layer's chunk on the transfer thread; return at once.

        At TP > 1 the other ranks write their heads of a layer in their own processes: they
        have, once this layer's o_proj all-reduce has returned here, so a layer's WRITEs are
        posted when the next layer's attention is done (the last one's in `wait_for_save`)."""
        pushes = self.connector_metadata.pushes
        if not pushes:
            return
        layer = self.layer_index[layer_name]
        if self.tp_size > 1:
            previous, self._unwritten = self._unwritten, layer
            if previous is not None:
                self._write_layer(pushes, previous, None)
            return
        self._write_layer(pushes, layer, kv_written_event(kv_cache))

    def _write_layer(self, pushes: list, layer: int, ready) -> None:
        deadline = time.monotonic() + self.cfg.load_timeout
        for plan in pushes:
            if staged := plan.staged:  # this layer's heads into D's shard layout, then whole
                staged.gather(layer, self.staging.shards, plan.local_blocks)
            future = submit(
                self.transport.write_layer,
                plan.target.engine_id,
                layer,
                range(len(plan.remote_blocks)) if staged else plan.local_blocks,
                plan.remote_blocks,
                notif=push_notif(plan.target.reservation_id, layer, plan.chunk, plan.is_final),
                deadline=fenced(deadline, plan.target.write_by),
                ready=ready,
                via=staged.layout if staged else None,
            )
            self.pushes.add_write(plan, future)
            if staged:
                staged.futures.append(future)

    def wait_for_all_loads(self) -> None:
        """D at TP > 1: every layer's reads landed (or failed) before the step's plan goes to
        the other ranks, whose forward reads their heads with no wait of its own."""
        for layer_name in self.layer_index:
            self.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        """Loads are done (the forward waited for each layer); pushes go on without us."""
        if self._unwritten is not None:  # TP > 1: the last layer, every rank past it
            self._write_layer(self.connector_metadata.pushes, self._unwritten, None)
            self._unwritten = None
        for plan in self.connector_metadata.loads:
            self.stats.num_loads += 1
            self.stats.num_failed += plan.failed
            self.stats.seconds_loading += time.perf_counter() - plan.started_at
            if not plan.failed:
                self.stats.loaded_requests["pull"] += 1
                for future in plan.group.futures if plan.group else []:
                    result = future.result()
                    self.stats.bytes_loaded += result.num_bytes
                    self.stats.descriptors += result.num_descriptors
                    self.stats.descriptors_a_layer.observe(
                        result.num_descriptors / len(self.layer_index)
                    )
            self._notify_release(plan.remote)
        self._futures.clear()

    def take_failed(self) -> dict[str, KVLoss]:
        failed, self._failed = self._failed, {}
        return failed

    # -- P: pushes settle in the background ---------------------------------------------------
    def is_sending(self, request_id: str) -> bool:
        return self.pushes.is_sending(request_id)

    def take_sent(self) -> dict[str, str | None]:
        return self.pushes.take_settled()

    # -- D: accounting ---------------------------------------------------------------------------
    def count_loaded(self, mode: str) -> None:
        self.stats.loaded_requests[mode] += 1

    def count_recomputed(self, reason: str) -> None:
        self.stats.recomputed[reason] += 1

    def stats_snapshot(self) -> KVTransferStats:
        loads, pushes = self.stats, self.pushes.stats
        incomplete = self.reservations.num_incomplete if self.reservations is not None else 0
        return KVTransferStats(
            num_loads=loads.num_loads,
            num_load_failures=loads.num_failed,
            num_bytes_loaded=loads.bytes_loaded,
            seconds_loading=loads.seconds_loading,
            num_load_descriptors=loads.descriptors,
            num_lease_expiries=self.leases.num_expired,
            num_bytes_pushed=pushes.num_bytes,
            seconds_pushing=pushes.seconds,
            seconds_push_exposed=pushes.seconds_exposed,
            num_push_failures=pushes.num_failures + incomplete,
            num_checksum_failures=loads.num_checksum_failures,
            num_blocks_held=self.leases.num_blocks_held,
            num_blocks_in_transfer=self.holds.num_blocks_held,
            num_blocks_quarantined=self.holds.num_quarantined,
            num_pushes_in_flight=len(self.pushes),
            loaded_requests=dict(loads.loaded_requests),
            recomputed=dict(loads.recomputed),
            descriptors={
                "read": loads.descriptors_a_layer.copy(),
                "write": pushes.descriptors_a_layer.copy(),
            },
        )

    def notify_release(self, remote: RemotePrefill) -> None:
        """Tell P it may free a request's blocks (also for requests D will not read)."""
        self._notify_release(remote)

    def _notify_release(self, remote: RemotePrefill) -> None:
        logger.debug("releasing %s on %s", remote.remote_request_id, remote.remote_engine_id)
        try:
            self.transport.send_notif(
                remote.remote_engine_id, RELEASE + remote.remote_request_id.encode()
            )
        except Exception as e:  # noqa: BLE001 — P may be gone; its lease expires anyway
            logger.warning(
                "could not release %s on %s: %r",
                remote.remote_request_id,
                remote.remote_engine_id,
                e,
            )
