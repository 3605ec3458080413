"""The NIXL connector's worker half: the transport and the KV tensors, and what runs inside the
forward. It carries out the step's plan (`StepMeta`, built by the scheduler half): starts the
step's READs before the first layer, waits for (and checks) each layer's before its attention,
posts each layer's WRITEs after it, and records which loads failed. It decides nothing about
requests: which blocks to read or write, and whom to tell, is the scheduler half's business.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from common.config import TransferConfig
from common.kv_cache.block_pool import Block
from common.kv_transfer.base import KVLoss, PeerInfo
from common.kv_transfer.layout import KVLayout, ShardTensors, distinct_heads
from common.kv_transfer.nixl.checksum import mismatch, request_checksums
from common.kv_transfer.nixl.holds import TransferGroup, TransferHolds
from common.kv_transfer.nixl.leases import fenced
from common.kv_transfer.nixl.push import PushPlan, PushTable
from common.kv_transfer.nixl.reservations import push_notif
from common.kv_transfer.nixl.staging import Staged, StagingPool
from common.kv_transfer.nixl.stats import TransferStats
from common.kv_transfer.params import RemotePrefill
from common.kv_transfer.transport import MakeTransport, Transport
from common.tracing import RequestTimes

logger = logging.getLogger(__name__)

RELEASE = b"release:"  # + request id: D tells P it may free a request's blocks


@dataclass
class LoadPlan:
    """D: the READ of one request's remote KV in this step."""

    request_id: str
    remote: RemotePrefill
    blocks: list[Block]  # local blocks the reads land in
    remote_blocks: list[int]
    first_block: int = 0  # index in the request of blocks[0] (blocks before: local hits)
    failed: bool = False
    started_at: float = 0.0
    group: TransferGroup | None = None
    staged: Staged | None = None  # read into a staging buffer first (staging.py)
    times: RequestTimes | None = None  # the request's: `kv_transfer_ns` set once it landed
    started_ns: int = 0
    landed_ns: int | None = None

    @property
    def local_blocks(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class StepMeta:
    """What the connector does in one engine step: built by the scheduler half, bound to the
    forward by the model runner, carried out here."""

    loads: list[LoadPlan] = field(default_factory=list)
    pushes: list[PushPlan] = field(default_factory=list)


def nixl_transport(engine_id: str, shards: list[ShardTensors]) -> Transport:
    """The NIXL transport of our KV (imported on use: NIXL loads a native library)."""
    from common.kv_transfer.nixl.transport import NixlTransport

    return NixlTransport(engine_id, shards)


def kv_written_event(kv_cache):
    """On CUDA, an event after the kernels that wrote this layer's KV: the transfer thread
    waits for it before a WRITE reads the blocks. None on CPU (writes are synchronous)."""
    if not kv_cache.is_cuda:
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def submit(transfer, *args, **kwargs) -> Future:
    """Start a transfer; one refused at once (an unknown peer, a closed transport) becomes a
    failed Future, handled like one that failed on the wire."""
    try:
        return transfer(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 — reported through the Future
        future: Future = Future()
        future.set_exception(e)
        return future


class NixlWorker:
    def __init__(
        self,
        cfg: TransferConfig,
        holds: TransferHolds,
        pushes: PushTable,
        stats: TransferStats,
        make_transport: MakeTransport = nixl_transport,
    ):
        self.cfg = cfg
        self.make_transport = make_transport
        self.holds = holds  # blocks a transfer touches stay referenced until it settles
        self.pushes = pushes  # P: each WRITE posted is recorded there
        self.stats = stats
        self.transport: Transport | None = None  # once the KV is registered
        self.staging = None
        self.kv_caches: list = []  # per layer: its shards holding each head once (checksums)
        self.layer_index: dict[str, int] = {}
        self.tp_size = 1
        self._unwritten: int | None = None  # TP push: the layer whose WRITEs wait
        self._futures: dict[int, list[tuple[LoadPlan, Future]]] = defaultdict(list)
        self._failed: dict[str, KVLoss] = {}  # request id → why its load failed

    # -- set-up and peers -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, shards: list | None) -> None:
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        shards = shards or [ShardTensors(0, list(kv_caches.values()))]
        self.tp_size = len(shards)
        distinct = distinct_heads(shards)
        self.kv_caches = [[s.kv_caches[layer] for s in distinct] for layer in range(len(kv_caches))]
        self.transport = self.make_transport(self.cfg.engine_id, shards)
        self.staging = StagingPool(self.transport, shards)

    @property
    def num_layers(self) -> int:
        return len(self.layer_index)

    def peer_info(self) -> PeerInfo | None:
        if self.transport is None:  # no KV registered yet
            return None
        return PeerInfo(self.transport.layout.to_dict(), self.transport.metadata())

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        self.transport.add_peer(KVLayout.from_dict(layout), metadata)

    def peer_layout(self, engine_id: str) -> KVLayout | None:
        return self.transport.peer_layout(engine_id)

    def get_notifs(self) -> list[bytes]:
        return self.transport.get_notifs() if self.transport else []

    def peer_transports(self) -> dict[str, frozenset[str]]:
        return self.transport.peer_transports() if self.transport else {}

    def notify_release(self, remote: RemotePrefill) -> None:
        """Tell P it may free a request's blocks; P may be gone: its lease expires anyway."""
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

    def settle(self) -> None:
        """Between steps: blocks and staging buffers whose transfers have settled go back."""
        self.holds.settle()
        if self.staging is not None:
            self.staging.settle()

    def has_pending(self) -> bool:
        return len(self.holds) > 0 or (self.staging is not None and len(self.staging) > 0)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- D: reads ----------------------------------------------------------------------------
    def refuse(self, plan: LoadPlan, loss: KVLoss) -> None:
        """Fail closed before anything is read: the step's token is dropped."""
        logger.warning("KV load for %s refused: %s", plan.request_id, loss)
        plan.failed = True
        self._failed[plan.request_id] = replace(loss, from_prefix=plan.remote.prefix_only)

    def take_failed(self) -> dict[str, KVLoss]:
        failed, self._failed = self._failed, {}
        return failed

    def start_load_kv(self, meta: StepMeta) -> None:
        deadline = time.monotonic() + self.cfg.load_timeout
        for plan in meta.loads:
            plan.started_at = time.perf_counter()
            plan.started_ns = time.time_ns()
            if plan.failed or not plan.blocks:  # refused, or a full local prefix hit
                continue
            plan.group = self.holds.hold(plan.blocks)
            peer = self.transport.peer_layout(plan.remote.remote_engine_id)
            plan.staged = peer and self.staging.for_read(peer, len(plan.blocks))
            staged = plan.staged
            future = submit(
                self.transport.read_layers,
                plan.remote.remote_engine_id,
                range(self.num_layers),
                range(len(plan.blocks)) if staged else plan.local_blocks,
                plan.remote_blocks,
                deadline=fenced(deadline, plan.remote.read_by),
                via=staged.layout if staged else None,
            )
            if staged:
                staged.futures.append(future)
            plan.group.futures.append(future)
            for layer in range(self.num_layers):
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
            plan.landed_ns = plan.landed_ns or time.time_ns()
            if plan.remote.read_by is not None and time.time() > plan.remote.read_by:
                # P may have freed and reused the blocks while this read was in flight
                why = "the prefill worker's lease ran out before the KV landed"
                self._fail_load(plan, "lease_expired", why)
                continue
            if plan.staged:  # the peer's blocks landed whole: our heads of them into ours
                plan.staged.scatter(layer, self.staging.shards, plan.local_blocks)
            self._check_layer(plan, layer)

    def _check_layer(self, plan: LoadPlan, layer: int) -> None:
        expected = plan.remote.kv_checksums
        if expected is None:
            return
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
        self._failed[plan.request_id] = KVLoss(reason, why, plan.remote.prefix_only)
        for future in plan.group.futures:
            future.cancel()

    def wait_for_all_loads(self) -> None:
        """D at TP > 1: every layer's reads landed (or failed) before the step's plan goes to
        the other ranks, whose forward reads their heads with no wait of its own."""
        for layer_name in self.layer_index:
            self.wait_for_layer_load(layer_name)

    def _finish_loads(self, meta: StepMeta) -> None:
        """After the forward: account for the step's loads and tell each P to let go."""
        for plan in meta.loads:
            self.stats.num_loads += 1
            self.stats.num_load_failures += plan.failed
            seconds = time.perf_counter() - plan.started_at
            self.stats.seconds_loading += seconds
            if not plan.failed and (plan.blocks or not plan.remote.prefix_only):
                self.stats.loaded_requests["reverse" if plan.remote.prefix_only else "pull"] += 1
                if plan.times is not None and plan.landed_ns is not None:
                    plan.times.kv_transfer_ns = (plan.started_ns, plan.landed_ns)
                self.stats.seconds_a_request.observe(seconds)
                for future in plan.group.futures if plan.group else []:
                    result = future.result()
                    self.stats.num_bytes_loaded += result.num_bytes
                    self.stats.num_load_descriptors += result.num_descriptors
                    self.stats.descriptors_a_layer.observe(result.num_descriptors / self.num_layers)
            self.notify_release(plan.remote)
        self._futures.clear()

    # -- checksums -----------------------------------------------------------------------------
    def checksums(self, block_ids: list[int]) -> list[list[int]]:
        """P: per layer, per block, what a reader checks the KV it got against."""
        return request_checksums(self.kv_caches, block_ids)

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

    # -- P: writes -----------------------------------------------------------------------------
    def save_kv_layer(self, meta: StepMeta, layer_name: str, kv_cache) -> None:
        """P, push mode: WRITE this layer's chunk on the transfer thread; return at once.

        At TP > 1 the other ranks write their heads of a layer in their own processes: they
        have, once this layer's o_proj all-reduce has returned here, so a layer's WRITEs are
        posted when the next layer's attention is done (the last one's in `wait_for_save`)."""
        if not meta.pushes:
            return
        layer = self.layer_index[layer_name]
        if self.tp_size > 1:
            previous, self._unwritten = self._unwritten, layer
            if previous is not None:
                self._write_layer(meta.pushes, previous, None)
            return
        self._write_layer(meta.pushes, layer, kv_written_event(kv_cache))

    def wait_for_save(self, meta: StepMeta) -> None:
        """Loads are done (the forward waited for each layer); pushes go on without us."""
        if self._unwritten is not None:  # TP > 1: the last layer, every rank past it
            self._write_layer(meta.pushes, self._unwritten, None)
            self._unwritten = None
        self._finish_loads(meta)

    def _write_layer(self, pushes: list[PushPlan], layer: int, ready) -> None:
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

    def staged_write(self, plan: PushPlan) -> Staged | None:
        """P: a staging buffer for a push to a peer that splits the heads otherwise."""
        peer = self.transport.peer_layout(plan.target.engine_id)
        return peer and self.staging.for_write(peer, len(plan.remote_blocks))
