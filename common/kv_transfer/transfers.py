"""What one KV transfer is, and how it ends, whatever the transport (transport.py): the Future
the caller holds (`TransferFuture`: done, failed, and *settled* once its memory is no longer
touched), its result and its error; and the running histograms a connector's stats carry to
/metrics (`KVTransferStats.descriptors`, `.seconds`). NIXL's own transfer job is nixl/job.py.
"""

from __future__ import annotations

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
