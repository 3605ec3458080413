"""What one KV transfer is, and how it ends, whatever the transport (transport.py): the Future
the caller holds (`TransferFuture`: done, failed, and *settled* once its memory is no longer
touched), its result and its error; the running histograms a connector's stats carry to
/metrics, and its running totals (`TransferStats`). Also what a connector starts one with:
`submit` (a refusal becomes a failed Future) and `kv_written_event` (what a WRITE of CUDA
memory waits for). NIXL's own transfer job is nixl/job.py.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar


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
