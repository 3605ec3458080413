"""Blocks a decode worker reserves for a prefill worker to push (WRITE) a prompt's KV into.

A reservation is complete once a notification for every layer has arrived (in any order). The
decode request then takes its blocks over; a reservation nobody claims expires and is freed.

P learns the reservation's expiry as `write_by` (wall clock, `skew_margin` early) and writes
nothing after it. A reservation released before P is done (P failed or was too slow, as far as
the proxy or D can tell) keeps its blocks until it expires or P's last notification arrives:
a frozen P that wakes up must write into blocks nobody else uses yet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common.kv_cache.block_pool import Block, BlockPool
from common.kv_transfer.leases import wall_deadline

PUSHED = b"pushed:"


@dataclass
class Reservation:
    reservation_id: str
    blocks: list[Block]
    expires_at: float
    write_by: float  # unix time: P's writes must have landed by then
    layers_done: set[int] = field(default_factory=set)


class ReservationTable:
    def __init__(
        self,
        pool: BlockPool,
        num_layers: int,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.num_layers = num_layers
        self.timeout = timeout
        self._clock = clock
        self._table: dict[str, Reservation] = {}
        self._released: dict[str, Reservation] = {}  # P may still write: blocks kept until expiry
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._table) + len(self._released)

    def reserve(self, num_blocks: int) -> Reservation:
        """Blocks for a push; `NoFreeBlocksError` when the pool cannot spare them."""
        blocks = self.pool.allocate(num_blocks)
        write_by = wall_deadline(self.timeout)
        res = Reservation(uuid.uuid4().hex, blocks, self._clock() + self.timeout, write_by)
        self._table[res.reservation_id] = res
        return res

    def on_notification(self, msg: bytes) -> None:
        """`pushed:<reservation id>:<layer>`; unknown or expired reservations are ignored."""
        rid, _, layer = msg[len(PUSHED) :].decode().rpartition(":")
        res = self._table.get(rid) or self._released.get(rid)
        if res is not None:
            res.layers_done.add(int(layer))
        if rid in self._released and self._is_done(res):  # P is done writing: free them now
            self._free(self._released.pop(rid))

    def is_complete(self, reservation_id: str) -> bool:
        res = self._table.get(reservation_id)
        return res is not None and self._is_done(res)

    def _is_done(self, res: Reservation) -> bool:
        return len(res.layers_done) == self.num_layers

    def is_known(self, reservation_id: str) -> bool:
        return reservation_id in self._table

    def claim(self, reservation_id: str) -> list[Block]:
        """The reservation's blocks, now owned by the caller (their references move with them)."""
        return self._table.pop(reservation_id).blocks

    def release(self, reservation_id: str) -> bool:
        """Give a reservation up; its blocks are freed now if P is done writing, else when
        it expires (or P's last notification arrives)."""
        res = self._table.pop(reservation_id, None)
        if res is None:
            return False
        if self._is_done(res):
            self._free(res)
        else:
            self._released[reservation_id] = res
        return True

    def expire(self) -> list[str]:
        """Free every reservation (given up or not) past its expiry; the ids not given up."""
        now = self._clock()
        expired = [rid for rid, res in self._table.items() if res.expires_at <= now]
        for rid in expired:
            self._free(self._table.pop(rid))
        for rid in [rid for rid, res in self._released.items() if res.expires_at <= now]:
            self._free(self._released.pop(rid))
        self.num_expired += len(expired)
        return expired

    def _free(self, res: Reservation) -> None:
        self.pool.free(list(reversed(res.blocks)))
