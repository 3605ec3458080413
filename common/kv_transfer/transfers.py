"""What one KV transfer is, and how it ends: the job the transfer thread carries
(`TransferJob`), the Future the caller holds (`TransferFuture`: done, failed, and *settled*
once its memory is no longer touched), its result and its error, and a connector's running
totals (`TransferStats`). The thread that moves the
bytes is common/kv_transfer/nixl_transport.py. Also what a connector starts one with: `submit`
(a refusal becomes a failed Future), `fenced` (the deadline a peer's lease or reservation
allows) and `kv_written_event` (what a WRITE of CUDA memory waits for).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from common.kv_transfer.leases import local_deadline

logger = logging.getLogger(__name__)


class TransferError(ConnectionError):
    """A transfer failed: the peer died or was removed, or NIXL refused it (see __cause__)."""


@dataclass
class TransferResult:
    num_bytes: int
    seconds: float  # from transfer() to DONE seen, on the transfer thread
    num_descriptors: int  # one per run of consecutive blocks per K/V
    post_s: float = 0.0  # building the descriptors and the handle: the cost of posting


DESCRIPTOR_BUCKETS = (2, 4, 8, 16, 32, 64, 128)  # 2 a layer: every block in one run both sides
# one request's KV transfer: a few ms on one host, seconds for a long prompt over TCP
_UNSETTLED_WARN_S = 10.0  # a handle NIXL keeps this long is logged (once)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class RunningHistogram:
    """A running histogram the engine thread observes into and /metrics exports (a copy):
    `counts[i]` of the values at or below `BUCKETS[i]`, the last one above them all."""

    BUCKETS: ClassVar[tuple[float, ...]] = ()
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.BUCKETS) + 1)

    def observe(self, value: float) -> None:
        bucket = next((i for i, b in enumerate(self.BUCKETS) if value <= b), -1)
        self.counts[bucket] += 1
        self.total += value

    def copy(self) -> RunningHistogram:
        return type(self)(list(self.counts), self.total)


class DescriptorHistogram(RunningHistogram):
    """NIXL descriptors a layer, one observation per request (pull) or per request's push: 2
    when its blocks are one run here and there, 2 per run otherwise."""

    BUCKETS = DESCRIPTOR_BUCKETS


class SecondsHistogram(RunningHistogram):
    """Seconds of one request's KV transfer: a pull's first READ to its load done (D), a push's
    first WRITE to its last one landing (P)."""

    BUCKETS = SECONDS_BUCKETS


@dataclass
class TransferStats:
    num_loads: int = 0
    num_failed: int = 0
    bytes_loaded: int = 0
    seconds_loading: float = 0.0
    descriptors: int = 0
    descriptors_a_layer: DescriptorHistogram = field(default_factory=DescriptorHistogram)
    seconds_a_request: SecondsHistogram = field(default_factory=SecondsHistogram)
    num_checksum_failures: int = 0
    loaded_requests: Counter = field(default_factory=Counter)  # pull, push (D); reverse (P)
    recomputed: Counter = field(default_factory=Counter)  # D: by KVLoss.reason


class TransferFuture(Future):
    """A transfer's outcome, and whether it can still touch memory (see `is_settled`)."""

    def __init__(self) -> None:
        super().__init__()
        self._is_settled = False

    def is_settled(self) -> bool:
        return self._is_settled or self.cancelled()

    def mark_settled(self, settled: bool = True) -> None:
        """The transfer no longer touches its memory (or, False: may still, until released)."""
        self._is_settled = settled


@dataclass
class TransferJob:
    """One READ or WRITE of one layer's blocks with one peer, from submission to settled."""

    op: str  # "READ" | "WRITE"
    peer: str
    local_descs: np.ndarray  # (n, 3) rows of (addr, len, device id)
    remote_descs: np.ndarray
    notif: bytes
    deadline: float | None
    num_bytes: int
    ready: Any = None  # a CUDA event the data waits on, or None
    future: TransferFuture = field(default_factory=TransferFuture)
    handle: Any = None
    started: float = 0.0
    post_s: float = 0.0
    unsettled_since: float = 0.0  # when NIXL first refused to release the handle (monotonic)
    release_error: str = ""  # its last refusal, for the log
    warned: bool = False

    def finish(self) -> bool:
        """DONE: release the handle and report the result; True if settled (released)."""
        seconds = time.monotonic() - self.started
        settled = self.release()
        self.future.mark_settled(settled)
        result = TransferResult(self.num_bytes, seconds, len(self.local_descs), self.post_s)
        self.future.set_result(result)
        return settled

    def fail(self, exc: BaseException) -> bool:
        """Release the handle (aborting an in-flight transfer) and report `exc` unless the
        Future is done already; True if settled."""
        settled = self.release()
        self.future.mark_settled(settled)
        if not self.future.done():
            self.future.set_exception(exc)
        return settled

    def try_settle(self, agent: Any) -> bool:
        """A failed job whose handle NIXL refused to release: release it once the transfer is
        no longer in progress. True once settled; a job unsettled for `_UNSETTLED_WARN_S` is
        logged once (its blocks stay quarantined until NIXL lets go)."""
        try:
            state = agent.check_xfer_state(self.handle)
        except Exception:  # noqa: BLE001 — the peer is gone: nothing can move any more
            state = "ERR"
        if state != "PROC" and self.release(quiet=True):
            return True
        waited = time.monotonic() - self.unsettled_since
        if waited > _UNSETTLED_WARN_S and not self.warned:
            self.warned = True
            logger.warning(
                "a %s with %s has not settled for %.0f s: state %s, release refused with %s; "
                "its local blocks stay quarantined", self.op, self.peer, waited, state,
                self.release_error or "nothing (still in progress)",
            )  # fmt: skip
        return False

    def release(self, quiet: bool = False) -> bool:
        """Release the handle; False (handle kept) if NIXL refused. Settles the Future."""
        if self.handle is not None:
            try:
                self.handle.release()
            except Exception as e:
                if not quiet:
                    why = "releasing a %s handle with %s failed: %r"
                    logger.warning(why, self.op, self.peer, e)
                self.release_error = repr(e)
                self.unsettled_since = self.unsettled_since or time.monotonic()
                return False
            self.handle = None
        self.future.mark_settled()
        return True


def as_transfer_error(job: TransferJob, exc: Exception) -> Exception:
    """What a transfer's Future fails with: a timeout or a TransferError (NIXL's error as cause)."""
    if isinstance(exc, (TimeoutError, TransferError)):
        return exc
    error = TransferError(f"{job.op} with {job.peer} failed: {exc!r}")
    error.__cause__ = exc
    return error


def fenced(deadline: float, peer_deadline: float | None) -> float:
    """The earlier of a local deadline and a peer's wall-clock one (its lease or reservation):
    a transfer never runs past the time the peer may reuse the blocks."""
    return deadline if peer_deadline is None else min(deadline, local_deadline(peer_deadline))


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
