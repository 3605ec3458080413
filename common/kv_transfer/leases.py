"""Blocks a prefill worker holds for a remote reader, each under a lease.

A lease ends when the reader says it is done, when D or the proxy releases it, or when it
expires; expiry is checked in expiry order. Held blocks are never evicted: they keep their
reference until the lease ends.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.kv_cache.block_pool import Block


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
