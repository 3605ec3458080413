"""Blocks a prefill worker holds for a remote reader, each under a lease.

A lease ends when the reader says it is done, when D or the proxy releases it, or when it
expires; expiry is checked in expiry order. Held blocks are never evicted: they keep their
reference until the lease ends.

The other side learns a lease's end as a wall-clock deadline (`wall_deadline`): a reader (or a
pushing writer) must have finished by then, `skew_margin` before the owner may free the blocks.
A reader that was frozen or slow past it fails closed instead of using reused blocks. A transfer
with a peer never runs past the peer's deadline (`fenced`).
NOTE: a transfer already inside NIXL when its process stops can still land late; the margin
covers short stalls there, not a peer frozen in the middle of a copy.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.kv_cache.block_pool import Block


def skew_margin(timeout: float) -> float:
    """How much earlier than the owner frees blocks a peer must be done with them: room for
    clock skew between hosts and for a transfer to land."""
    return min(1.0, timeout / 10)


def wall_deadline(timeout: float) -> float:
    """For a peer: the unix time by which a transfer of blocks held `timeout` seconds from now
    must be complete."""
    return time.time() + timeout - skew_margin(timeout)


def local_deadline(wall: float) -> float:
    """A peer's wall-clock deadline on this host's monotonic clock."""
    return time.monotonic() + (wall - time.time())


def fenced(deadline: float, peer_deadline: float | None) -> float:
    """The earlier of a local deadline and a peer's wall-clock one (its lease or reservation):
    a transfer never runs past the time the peer may reuse the blocks."""
    return deadline if peer_deadline is None else min(deadline, local_deadline(peer_deadline))


@dataclass
class Lease:
    request_id: str
    blocks: list[Block]
    expires_at: float


class LeaseTable:
    def __init__(
        self,
        free: Callable[[list[Block]], None],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._free = free
        self.timeout = timeout
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_blocks_held(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())

    def hold(self, request_id: str, blocks: list[Block]) -> None:
        assert request_id not in self._leases, f"{request_id} is already leased"
        lease = Lease(request_id, list(blocks), self._clock() + self.timeout)
        self._leases[request_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, request_id))

    def release(self, request_id: str) -> bool:
        """End a lease (reader done, or an explicit abort); False if there was none."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._free(list(reversed(lease.blocks)))
        return True

    def expire(self) -> list[str]:
        """End every lease past its expiry; their request ids."""
        now, expired = self._clock(), []
        while self._expiry and self._expiry[0][0] <= now:
            _, request_id = heapq.heappop(self._expiry)
            if self.release(request_id):
                expired.append(request_id)
        self.num_expired += len(expired)
        return expired
