"""NIXL transport: one agent per worker; moves KV blocks of some layers to or from a peer. The
`Transport` (common/kv_transfer/transport.py) of the NIXL connector.

Contract
- `NixlTransport(engine_id, kv_caches)` registers every layer's paged KV tensor (contiguous,
  (2, num_blocks, block_size, num_kv_heads, head_dim)) once, every rank's at TP > 1
  (`ShardTensors`); `register` adds memory (staging buffers, staging.py).
- A transfer is one descriptor per run of blocks consecutive on both sides, per K/V (layout.py
  `runs`), built in O(runs), nothing per block (docs/benchmarks.md); between different head
  splits a shard's heads move token by token (layout.py `transfer_descs`).
- A peer is added from its `KVLayout` and `metadata()` (again: a no-op); a layout its memory
  does not cover is refused then. Retired (a restarted worker's old engine id), idle
  (`peer_idle_s`) and, past `max_peers`, least recently used idle peers are dropped when a peer
  is added, once none of their transfers is in flight.
- `read_layers` / `write_layer` move the K and V bytes of the given blocks of some layers (one
  NIXL transfer) and return a Future[TransferResult] at once. One transfer thread starts them
  in submission order (with cma the copy runs inside `transfer()`, GIL released) and polls the
  in-flight ones. A dead peer fails the Future with TransferError; one still running at the
  caller's deadline with TimeoutError (NIXL has none). Future callbacks run on the transfer
  thread: keep them short (`loop.call_soon_threadsafe`). A WRITE's `ready` (a CUDA event) is
  waited for before posting: it never reads VRAM a kernel queued before it still writes.
- The Future (`TransferFuture`) also tells when the transfer has *settled* (`is_settled()`):
  done, failed with its handle released (an abort), or cancelled before it started. Memory a
  failed transfer touched may be reused only once it has settled: a handle NIXL refuses to
  release is polled until it leaves "PROC" and released then.
- NOTE: over a cma connection, transfers with a SIGSTOPped peer complete (the kernel copies);
  connecting to it, or a transfer after a notif to it, runs until the deadline.
- A transfer's notif reaches the peer after its data; notifs of different transfers may come
  out of order. Memory a peer may still read must stay registered: reading deregistered memory
  of a live peer breaks the connection to it for good.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from common.kv_transfer.layout import (
    KVLayout,
    ShardTensors,
    as_shards,
    registration_regions,
    runs,
    transfer_descs,
)
from common.kv_transfer.nixl import transport_info
from common.kv_transfer.nixl.agent import create_agent
from common.kv_transfer.nixl.job import TransferJob, as_transfer_error
from common.kv_transfer.transfers import TransferError, TransferFuture, TransferResult
from common.kv_transfer.transport import Transport
from common.settings import Settings

logger = logging.getLogger(__name__)

_MIN_POLL_S = 50e-6  # poll backoff while transfers are in flight: 50 µs doubling up to 1 ms
_MAX_POLL_S = 1e-3
_NOTHING = object()  # the queue had no item


@dataclass(frozen=True)
class TransferOrder:
    """What one READ or WRITE moves: the K and V of `local_blocks` of `layers` here (or of
    `via`, a staging buffer's layout) to or from the peer's `remote_blocks`."""

    op: str  # "READ" | "WRITE"
    peer: str  # engine id
    layers: Sequence[int]
    local_blocks: Sequence[int]
    remote_blocks: Sequence[int]
    notif: bytes = b""  # delivered to the peer after the data
    deadline: float | None = None  # time.monotonic(): failed with TimeoutError past it
    ready: Any = None  # WRITE on CUDA: the event after the kernels that wrote the layer
    via: KVLayout | None = None


@dataclass
class Peer:
    """What the transport keeps per peer. A peer is dropped when it is retired (a restarted
    worker's old engine id) or idle for `peer_idle_s`, and, past `max_peers`, the least
    recently used idle ones go too; one with a transfer not yet settled always stays."""

    layout: KVLayout
    last_used: float = field(default_factory=time.monotonic)
    is_retired: bool = False


def stale_peers(peers: dict[str, Peer], busy: set[str], idle_s: float, max_peers: int) -> set[str]:
    """The engine ids to drop now."""
    idle_since = time.monotonic() - idle_s
    by_age = sorted(peers.items(), key=lambda item: item[1].last_used)
    idle = [engine_id for engine_id, _ in by_age if engine_id not in busy]
    stale = {e for e in idle if peers[e].is_retired or peers[e].last_used < idle_since}
    num_over = len(peers) - len(stale) - max_peers
    stale.update([e for e in idle if e not in stale][: max(num_over, 0)])
    return stale


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


def progress_delay() -> int:
    """µs between the agent's progress-thread polls: `PDSERVE_NIXL_PROGRESS_DELAY_US`, else
    1000 (an idle agent then takes ~1.5% of a core; the wrapper's own 0 spins a whole core)."""
    return Settings.from_env().nixl_progress_delay_us


class NixlTransport(Transport):
    def __init__(
        self,
        engine_id: str,
        kv_caches: Sequence[torch.Tensor] | Sequence[ShardTensors],
        progress_delay_us: int | None = None,
        peer_idle_s: float = 300.0,
        max_peers: int = 64,
    ) -> None:
        self.peer_idle_s = peer_idle_s
        self.max_peers = max_peers
        agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self.layout = KVLayout.of(engine_id, agent_name, kv_caches)
        self._agent = create_agent(agent_name, progress_delay_us or progress_delay())
        # registered memory must outlive the agent's use of it
        self._kv_caches = [t for shard in as_shards(kv_caches) for t in shard.kv_caches]
        device = self.layout.device_id
        regions = [(addr, size, device, "") for addr, size in registration_regions(self._kv_caches)]
        self._registered = self._agent.register_memory(regions, self.layout.mem_type)
        self._peers: dict[str, Peer] = {}  # written only on the transfer thread
        self._inflight: list[TransferJob] = []  # transfer thread only
        self._aborting: list[TransferJob] = []  # failed, handle not yet released: not settled
        self._queue: queue.SimpleQueue[TransferJob | _Command | None] = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-{engine_id}", daemon=True)
        self._thread.start()

    # -- peers ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, layout: KVLayout, metadata: bytes) -> None:
        """Load a peer's agent metadata (a no-op for a known one); then sweep stale peers."""
        self.layout.check_peer(layout)
        self._call(lambda: self._add_peer(layout, metadata))

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer; its in-flight transfers fail with TransferError."""
        self._call(lambda: self._drop_peer(engine_id))

    def retire_peer(self, engine_id: str) -> None:
        """A peer that will not be used again (its worker restarted): removed once its
        in-flight transfers have settled."""
        self._call(lambda: self._retire_peer(engine_id))

    def has_peer(self, engine_id: str) -> bool:
        peer = self._peers.get(engine_id)
        return peer is not None and not peer.is_retired

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def peer_transports(self) -> dict[str, frozenset[str]]:
        """{peer agent name: the UCX transports of our READs or WRITEs with it}, as UCX
        reported them (transport_info.py); empty while UCX's log is not read."""
        return transport_info.snapshot(self.layout.agent_name)

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
        """Copy the peer's `remote_blocks` of `layers` into our `local_blocks` (K and V), as
        one transfer: its fixed costs (posting, the thread's turn, the Future) once, not per
        layer. `via`: the blocks of another layout of ours (a staging buffer) instead."""
        return self._submit(
            TransferOrder(
                "READ", peer, layers, local_blocks, remote_blocks, notif, deadline, via=via
            )
        )

    def read_layer(self, peer: str, layer: int, *args: Any, **kwargs: Any) -> TransferFuture:
        """`read_layers` of one layer."""
        return self.read_layers(peer, [layer], *args, **kwargs)

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
        """Copy our (or `via`'s) `local_blocks` of `layer` to the peer's, after `ready`."""
        return self._submit(
            TransferOrder(
                "WRITE", peer, [layer], local_blocks, remote_blocks, notif, deadline, ready, via
            )
        )

    def register(self, tensor: torch.Tensor) -> Any:
        """Register more local memory (a staging buffer); returns its handle."""
        region = [(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0, "")]
        return self._call(lambda: self._agent.register_memory(region, self.layout.mem_type))

    def deregister(self, registration: Any) -> None:
        self._call(lambda: self._agent.deregister_memory(registration))

    def peer_layout(self, engine_id: str) -> KVLayout | None:
        return (peer := self._peers.get(engine_id)) and peer.layout

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._agent.send_notif(self._peer(peer).layout.agent_name, msg)

    def get_notifs(self) -> list[bytes]:
        """Notification messages received from any peer since the last call."""
        return [msg for msgs in self._agent.get_new_notifs().values() for msg in msgs]

    def close(self) -> None:
        """Fail pending transfers, release every handle, deregister the KV memory."""
        assert threading.current_thread() is not self._thread, "close() from a Future callback"
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        self._agent = None  # the C++ agent (and its progress thread) goes with the last reference

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller side helpers -------------------------------------------------------------------
    def _peer(self, engine_id: str) -> Peer:
        peer = self._peers.get(engine_id)
        if peer is None:
            raise ValueError(f"unknown peer {engine_id!r}")
        peer.last_used = time.monotonic()
        return peer

    def _submit(self, order: TransferOrder) -> TransferFuture:
        start = time.perf_counter()
        block_runs = runs(order.local_blocks, order.remote_blocks)
        local, remote = transfer_descs(  # row i here is row i there
            order.via or self.layout,
            self._peer(order.peer).layout,
            order.layers,
            block_runs,
            order.op == "READ",
        )
        num_bytes = int(local[:, 1].sum())
        job = TransferJob(
            order.op, order.peer, local, remote, order.notif, order.deadline, num_bytes, order.ready
        )
        job.post_s = time.perf_counter() - start
        self._enqueue(job)
        return job.future

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the transfer thread, which owns peer state, and wait for it."""
        command = _Command(fn)
        self._enqueue(command)
        return command.future.result()

    def _enqueue(self, item: TransferJob | _Command) -> None:
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("transport is closed")
            self._queue.put(item)

    # -- transfer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug: fail everything rather than leave Futures hanging
            with self._submit_lock:
                self._closed = True
            self._shutdown()
            raise

    def _loop(self) -> None:
        wait = _MIN_POLL_S
        while True:
            try:  # sleeps until work arrives, or for the poll interval while transfers run
                busy = self._inflight or self._aborting
                item = self._queue.get(timeout=wait if busy else None)
            except queue.Empty:
                item = _NOTHING
            while item is not _NOTHING:
                if item is None:
                    return self._shutdown()
                self._handle(item)
                item = self._next_nowait()
            finished = self._poll()
            wait = _MIN_POLL_S if finished else min(2 * wait, _MAX_POLL_S)

    def _next_nowait(self) -> Any:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return _NOTHING

    def _handle(self, item: TransferJob | _Command) -> None:
        if isinstance(item, TransferJob):
            return self._start(item)
        if item.future.set_running_or_notify_cancel():
            try:
                item.future.set_result(item.fn())
            except Exception as e:
                item.future.set_exception(e)

    def _start(self, job: TransferJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            self._post(job)
        except Exception as e:
            return self._fail(job, as_transfer_error(job, e))
        if not self._settle(job, "PROC"):
            self._inflight.append(job)

    def _post(self, job: TransferJob) -> None:
        if job.deadline is not None and time.monotonic() > job.deadline:
            raise TimeoutError(f"{job.op} from {job.peer}: deadline passed while queued")
        peer = self._peers.get(job.peer)
        if peer is None:
            raise TransferError(f"peer {job.peer!r} was removed")
        if job.ready is not None:  # the layer's KV kernels have finished writing VRAM
            job.ready.synchronize()
        if len(job.local_descs) == 0:  # nothing to move: still deliver the notification
            if job.notif:
                self._agent.send_notif(peer.layout.agent_name, job.notif)
            job.future.mark_settled()
            return job.future.set_result(TransferResult(0, 0.0, 0, job.post_s))
        start = time.perf_counter()
        local = self._agent.get_xfer_descs(job.local_descs, self.layout.mem_type)
        remote = self._agent.get_xfer_descs(job.remote_descs, peer.layout.mem_type)
        job.handle = self._agent.initialize_xfer(
            job.op, local, remote, peer.layout.agent_name, job.notif
        )
        job.post_s += time.perf_counter() - start
        job.started = time.monotonic()
        if self._agent.transfer(job.handle) == "DONE":
            self._finish(job)

    def _poll(self) -> bool:
        """Check every in-flight transfer once; True if any finished."""
        still = []
        for job in self._inflight:
            try:
                state = self._agent.check_xfer_state(job.handle)
            except Exception as e:
                self._fail(job, as_transfer_error(job, e))
                continue
            if not self._settle(job, state):
                still.append(job)
        finished = len(still) < len(self._inflight)
        self._inflight = still
        self._aborting = [job for job in self._aborting if not job.try_settle(self._agent)]
        return finished

    def _settle(self, job: TransferJob, state: str) -> bool:
        """Resolve the job if `state` or its deadline ends it; True if it is over."""
        if job.future.done():
            return True
        if state == "DONE":
            self._finish(job)
        elif state == "ERR":
            self._fail(job, TransferError(f"{job.op} with {job.peer} failed (ERR)"))
        elif job.deadline is not None and time.monotonic() > job.deadline:
            self._fail(job, TimeoutError(f"{job.op} with {job.peer} still running at deadline"))
        return job.future.done()

    def _finish(self, job: TransferJob) -> None:
        if not job.finish():  # NIXL kept the handle: settled once it lets go
            self._aborting.append(job)

    def _fail(self, job: TransferJob, exc: BaseException) -> None:
        if not job.fail(exc):  # releasing an in-flight handle aborts it; data is partial
            self._aborting.append(job)  # may still move data: settled once NIXL lets go

    def _add_peer(self, layout: KVLayout, metadata: bytes) -> None:
        known = self._peers.get(layout.engine_id)
        if known is not None and known.layout.agent_name == layout.agent_name:
            known.last_used, known.is_retired = time.monotonic(), False
            return self._sweep_peers()
        self._drop_peer(layout.engine_id)
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != layout.agent_name:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"metadata is of agent {name!r}, layout of {layout.agent_name!r}")
        try:  # the layout must lie inside the peer's registered memory (else nixlNotFoundError)
            self._agent.prep_xfer_dlist(name, layout.region_descs(), layout.mem_type).release()
        except Exception:
            if all(p.layout.agent_name != name for p in self._peers.values()):
                self._agent.remove_remote_agent(name)
            raise
        self._peers[layout.engine_id] = Peer(layout)
        self._sweep_peers()

    def _retire_peer(self, engine_id: str) -> None:
        if (peer := self._peers.get(engine_id)) is not None:
            peer.is_retired = True
        self._sweep_peers()

    def _sweep_peers(self) -> None:
        """Drop retired and idle peers, then the least recently used idle ones past
        `max_peers`; a peer with a transfer in flight stays."""
        busy = {job.peer for job in self._inflight + self._aborting}  # not settled yet
        for engine_id in stale_peers(self._peers, busy, self.peer_idle_s, self.max_peers):
            logger.info("removing idle or retired NIXL peer %s", engine_id)
            self._drop_peer(engine_id)

    def _drop_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        for job in self._inflight:
            if job.peer == engine_id:
                self._fail(job, TransferError(f"peer {engine_id!r} was removed"))
        self._inflight = [job for job in self._inflight if job.peer != engine_id]
        try:
            self._agent.remove_remote_agent(peer.layout.agent_name)
        except Exception:
            logger.warning("removing NIXL agent %s failed", peer.layout.agent_name)

    def _shutdown(self) -> None:
        closed = RuntimeError("transport closed")
        while (item := self._next_nowait()) is not _NOTHING:
            if item is not None and not item.future.done():
                item.future.set_exception(closed)
        for job in self._inflight:
            self._fail(job, closed)
        self._inflight = []
        for engine_id in list(self._peers):
            self._drop_peer(engine_id)
        self._agent.deregister_memory(self._registered)
