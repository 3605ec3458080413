"""The NIXL connector: pull-mode KV transfer between a prefill (P) and a decode (D) worker.

P (`do_remote_decode`): the request prefills and samples its first token as usual; when it
finishes, its blocks go under a lease instead of back to the pool, and its output carries
`kv_transfer_params` saying where they are (`RemotePrefill`).

D (`do_remote_prefill`): on admission the request counts every prompt token it lacks as
computed elsewhere, so it is scheduled for a single token (the one after the prompt, or the
last prompt token when no first token came along). Its blocks are allocated, its own prefix hits
skipped; `start_load_kv` issues one NIXL READ per layer for the rest, and the forward's
decorator waits for each layer just before that layer's attention. After the forward D tells P
to release the lease. A read that fails or passes `load_timeout` marks the request failed: the
engine drops its token and recomputes it locally or fails it, by policy.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from common.config import TransferConfig
from common.kv_transfer.base import KVConnector
from common.kv_transfer.leases import LeaseTable
from common.kv_transfer.params import RemotePrefill, wants_remote_decode

logger = logging.getLogger(__name__)

RELEASE = b"release:"


@dataclass
class LoadPlan:
    request_id: str
    remote: RemotePrefill
    local_blocks: list[int]
    remote_blocks: list[int]
    failed: bool = False
    started_at: float = 0.0


@dataclass
class StepMeta:
    loads: list[LoadPlan]


@dataclass
class TransferStats:
    num_loads: int = 0
    num_failed: int = 0
    bytes_loaded: int = 0
    seconds_loading: float = 0.0
    descriptors: int = 0
    last_load: dict = field(default_factory=dict)


class NixlConnector(KVConnector):
    def __init__(self, cfg: TransferConfig, block_size: int, free_blocks):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.leases = LeaseTable(free_blocks, cfg.lease_timeout)
        self.transport = None
        self.layer_index: dict[str, int] = {}
        self.stats = TransferStats()
        self._plans: dict[str, LoadPlan] = {}
        self._futures: dict[int, list[tuple[LoadPlan, Future]]] = defaultdict(list)
        self._failed: set[str] = set()

    # -- set-up and peers -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        from common.kv_transfer.nixl_transport import NixlTransport

        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.transport = NixlTransport(self.cfg.engine_id, list(kv_caches.values()))

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        from common.kv_transfer.nixl_transport import KVLayout

        self.transport.add_peer(KVLayout.from_dict(layout), metadata)

    def has_peer(self, engine_id: str) -> bool:
        return self.transport.has_peer(engine_id)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- P: hold blocks for the reader ------------------------------------------------------------
    def request_finished(self, request: Any) -> bool:
        if not wants_remote_decode(request.kv_transfer_params) or not request.output_token_ids:
            return False
        if request.status.name == "FINISHED_ABORTED" or not request.blocks:
            return False
        self.leases.hold(request.request_id, request.blocks)
        request.kv_transfer_params_out = RemotePrefill(
            remote_engine_id=self.cfg.engine_id,
            remote_block_ids=request.block_ids,
            remote_request_id=request.request_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self.cfg.advertise_port,
            first_token_id=request.output_token_ids[0],
        ).to_dict()
        request.blocks = []
        return True

    def release(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    def poll(self) -> None:
        for msg in self.transport.get_notifs() if self.transport else []:
            logger.debug("notification %r", msg)
            if msg.startswith(RELEASE):
                self.leases.release(msg[len(RELEASE) :].decode())
        for request_id in self.leases.expire():
            logger.warning("lease of %s expired: its blocks are freed", request_id)

    def has_pending(self) -> bool:
        return len(self.leases) > 0

    # -- D: plan, start and wait for reads -----------------------------------------------------
    def num_external_tokens(self, request: Any, num_local_cached: int) -> int:
        if request.remote_prefill is None:
            return 0
        return request.num_tokens - 1 - num_local_cached

    def after_allocation(self, request: Any, num_local_cached: int) -> None:
        remote = request.remote_prefill
        if remote is None:
            return
        first = num_local_cached // self.block_size
        last = min(len(remote.remote_block_ids), len(request.blocks))
        self._plans[request.request_id] = LoadPlan(
            request.request_id,
            remote,
            request.block_ids[first:last],
            remote.remote_block_ids[first:last],
        )
        request.remote_prefill = None  # loaded once; a later recompute is local

    def build_connector_meta(self, scheduled: list) -> StepMeta | None:
        loads = [
            self._plans.pop(req.request_id) for req, _ in scheduled if req.request_id in self._plans
        ]
        return StepMeta(loads) if loads else None

    def start_load_kv(self, ctx) -> None:
        deadline = time.monotonic() + self.cfg.load_timeout
        for plan in self.connector_metadata.loads:
            plan.started_at = time.perf_counter()
            if not plan.local_blocks:  # a full local prefix hit: nothing to read
                continue
            for layer in range(len(self.layer_index)):
                try:
                    future = self.transport.read_layer(
                        plan.remote.remote_engine_id,
                        layer,
                        plan.local_blocks,
                        plan.remote_blocks,
                        deadline=deadline,
                    )
                except Exception as e:  # noqa: BLE001 — e.g. an unknown peer: the load fails
                    future = Future()
                    future.set_exception(e)
                self._futures[layer].append((plan, future))

    def wait_for_layer_load(self, layer_name: str) -> None:
        for plan, future in self._futures.pop(self.layer_index[layer_name], []):
            if plan.failed:
                continue
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 — any failed read fails the request
                logger.warning("KV read for %s failed: %r", plan.request_id, e)
                plan.failed = True
                self._failed.add(plan.request_id)
                continue
            self.stats.bytes_loaded += result.num_bytes
            self.stats.descriptors += result.num_descriptors

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata) -> None:
        return None  # pull mode: the reader pulls

    def wait_for_save(self) -> None:
        for plan in self.connector_metadata.loads:
            self.stats.num_loads += 1
            self.stats.num_failed += plan.failed
            self.stats.seconds_loading += time.perf_counter() - plan.started_at
            self._notify_release(plan.remote)
        self._futures.clear()

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

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
