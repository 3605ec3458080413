"""Blocks a decode worker reserves for a prefill worker to push (WRITE) a prompt's KV into.

P pushes a prompt in chunks (one per prefill step); every chunk's WRITE of every layer carries a
notification, `pushed:<reservation>:<layer>:<chunk>`, and the final chunk's say so
(`...:<chunk>:last`). A notification reaches D only after its data has landed. A reservation is
complete once every (layer, chunk) up to the final chunk has reported, in any order: a chunk
whose WRITE failed never reports, so D never decodes from KV with holes in it. The decode
request then takes the blocks over; a reservation nobody claims expires and is freed.

A reservation may start with blocks D already holds: the cached leading blocks of the prompt
(an earlier turn's), referenced, not written by P (`num_held`; P learns it from the push
target and writes, and checksums, only the blocks after them).

P learns the reservation's expiry as `write_by` (wall clock, `skew_margin` early) and writes
nothing after it. A reservation released before P is done (P failed or was too slow, as far as
the proxy or D can tell) keeps its blocks until it expires or P's last notification arrives:
a frozen P that wakes up must write into blocks nobody else uses yet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from common.kv_cache.block_pool import Block, BlockPool, NoFreeBlocksError
from common.kv_transfer.base import Reservation
from common.kv_transfer.nixl.leases import wall_deadline

PUSHED = b"pushed:"
_LAST = "last"


def push_notif(reservation_id: str, layer: int, chunk: int, is_final: bool) -> bytes:
    """The notification a push chunk's WRITE of one layer carries."""
    tail = f":{_LAST}" if is_final else ""
    return PUSHED + f"{reservation_id}:{layer}:{chunk}{tail}".encode()


def parse_push_notif(msg: bytes) -> tuple[str, int, int, bool]:
    """(reservation id, layer, chunk, is_final) of a `push_notif`; ValueError if malformed."""
    parts = msg[len(PUSHED) :].decode().split(":")
    is_final = parts[-1] == _LAST
    if is_final:
        parts = parts[:-1]
    if len(parts) != 3:
        raise ValueError(f"malformed push notification {msg!r}")
    return parts[0], int(parts[1]), int(parts[2]), is_final


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
        self.num_incomplete = 0  # given up or expired before every chunk landed
        self.num_blocks_held = 0  # reserved from the prefix cache: P did not write them

    def __len__(self) -> int:
        return len(self._table) + len(self._released)

    def reserve(self, num_blocks: int, held: list[Block] | None = None) -> Reservation:
        """`num_blocks` blocks for a push, led by `held` (cached blocks of the prompt's
        prefix, referenced by the caller, which P does not write); `NoFreeBlocksError` when
        the pool cannot spare the rest (`held` is freed then)."""
        held = held or []
        after = held[-1].block_id if held else None
        try:
            blocks = held + self.pool.allocate(num_blocks - len(held), after=after)
        except NoFreeBlocksError:
            self.pool.free(list(reversed(held)))
            raise
        write_by = wall_deadline(self.timeout)
        res = Reservation(uuid.uuid4().hex, blocks, self._clock() + self.timeout, write_by)
        res.num_held = len(held)
        self.num_blocks_held += len(held)
        self._table[res.reservation_id] = res
        return res

    def on_notification(self, msg: bytes) -> None:
        """A chunk of one layer landed; unknown or expired reservations are ignored."""
        rid, layer, chunk, is_final = parse_push_notif(msg)
        res = self._table.get(rid) or self._released.get(rid)
        if res is None or not 0 <= layer < self.num_layers:
            return
        res.landed.add((layer, chunk))
        if is_final:
            res.num_chunks = chunk + 1
        if rid in self._released and self._is_done(res):  # P is done writing: free them now
            self._free(self._released.pop(rid))

    def is_complete(self, reservation_id: str) -> bool:
        res = self._table.get(reservation_id)
        return res is not None and self._is_done(res)

    def _is_done(self, res: Reservation) -> bool:
        if res.num_chunks is None:
            return False
        want = self.num_layers * res.num_chunks
        return len(res.landed) == want and all(c < res.num_chunks for _, c in res.landed)

    def is_known(self, reservation_id: str) -> bool:
        return reservation_id in self._table

    def claim(self, reservation_id: str) -> Reservation:
        """The reservation, its blocks now owned by the caller (their references move with them)."""
        return self._table.pop(reservation_id)

    def release(self, reservation_id: str) -> bool:
        """Give a reservation up; its blocks are freed now if P is done writing, else when
        it expires (or P's last notification arrives)."""
        res = self._table.pop(reservation_id, None)
        if res is None:
            return False
        if self._is_done(res):
            self._free(res)
        else:
            self.num_incomplete += 1
            self._released[reservation_id] = res
        return True

    def expire(self) -> list[str]:
        """Free every reservation (given up or not) past its expiry; the ids not given up."""
        now = self._clock()
        expired = [rid for rid, res in self._table.items() if res.expires_at <= now]
        for rid in expired:
            res = self._table.pop(rid)
            self.num_incomplete += not self._is_done(res)
            self._free(res)
        for rid in [rid for rid, res in self._released.items() if res.expires_at <= now]:
            self._free(self._released.pop(rid))
        self.num_expired += len(expired)
        return expired

    def _free(self, res: Reservation) -> None:
        self.pool.free(list(reversed(res.blocks)))
