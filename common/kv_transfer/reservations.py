"""Blocks a decode worker reserves for a prefill worker to push (WRITE) a prompt's KV into.

A reservation is complete once a notification for every layer has arrived (in any order). The
decode request then takes its blocks over; a reservation nobody claims expires and is freed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common.kv_cache.block_pool import Block, BlockPool

PUSHED = b"pushed:"


@dataclass
class Reservation:
    reservation_id: str
    blocks: list[Block]
    expires_at: float
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
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._table)

    def reserve(self, num_blocks: int) -> Reservation:
        """Blocks for a push; `NoFreeBlocksError` when the pool cannot spare them."""
        blocks = self.pool.allocate(num_blocks)
        res = Reservation(uuid.uuid4().hex, blocks, self._clock() + self.timeout)
        self._table[res.reservation_id] = res
        return res

    def on_notification(self, msg: bytes) -> None:
        """`pushed:<reservation id>:<layer>`; unknown or expired reservations are ignored."""
        rid, _, layer = msg[len(PUSHED) :].decode().rpartition(":")
        res = self._table.get(rid)
        if res is not None:
            res.layers_done.add(int(layer))

    def is_complete(self, reservation_id: str) -> bool:
        res = self._table.get(reservation_id)
        return res is not None and len(res.layers_done) == self.num_layers

    def is_known(self, reservation_id: str) -> bool:
        return reservation_id in self._table

    def claim(self, reservation_id: str) -> list[Block]:
        """The reservation's blocks, now owned by the caller (their references move with them)."""
        return self._table.pop(reservation_id).blocks

    def release(self, reservation_id: str) -> bool:
        res = self._table.pop(reservation_id, None)
        if res is not None:
            self.pool.free(list(reversed(res.blocks)))
        return res is not None

    def expire(self) -> list[str]:
        now = self._clock()
        expired = [rid for rid, res in self._table.items() if res.expires_at <= now]
        for rid in expired:
            self.release(rid)
        self.num_expired += len(expired)
        return expired
