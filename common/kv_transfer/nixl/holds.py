"""Blocks that NIXL transfers read from or write into, held until every such transfer settles.

A transfer group (one request's READs in a step on D, or one push chunk's WRITEs on P) takes
one extra reference on each of its local blocks when it starts and drops it once every transfer
of the group has settled: completed, failed and released by the transport, or cancelled before
it started. So a request that fails, is aborted or finishes while its transfers are still in
flight gives its blocks back, but the pool hands them out again only when nothing can land in
them (or read from them) any more. Blocks whose only references are such transfers are
*quarantined*: counted, never allocated, and freed by `settle()` between steps.

Engine thread only, like the pool.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.kv_cache.block_pool import Block, BlockPool


@dataclass
class TransferGroup:
    blocks: list[Block]
    futures: list = field(default_factory=list)  # TransferFuture (or any Future) per transfer

    @property
    def is_settled(self) -> bool:
        return all(_settled(f) for f in self.futures)


class TransferHolds:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._groups: list[TransferGroup] = []
        self._refs: Counter[int] = Counter()  # block id → references held by open groups

    def __len__(self) -> int:
        return len(self._groups)

    def hold(self, blocks: list[Block]) -> TransferGroup:
        """Reference `blocks` until the group's transfers (appended to `.futures`) settle."""
        self.pool.touch(blocks)
        self._refs.update(b.block_id for b in blocks)
        group = TransferGroup(list(blocks))
        self._groups.append(group)
        return group

    def settle(self) -> int:
        """Drop the references of every group whose transfers have all settled; how many."""
        done = [g for g in self._groups if g.is_settled]
        if done:
            self._groups = [g for g in self._groups if not g.is_settled]
        for group in done:
            self._refs.subtract(b.block_id for b in group.blocks)
            self.pool.free(list(reversed(group.blocks)))
        self._refs = +self._refs  # drop zero counts
        return len(done)

    @property
    def num_blocks_held(self) -> int:
        return len(self._refs)

    @property
    def num_quarantined(self) -> int:
        """Blocks referenced by nothing but unsettled transfers (their owner let them go)."""
        blocks = self.pool.blocks
        return sum(1 for i, n in self._refs.items() if blocks[i].ref_count == n)


def _settled(future) -> bool:
    is_settled = getattr(future, "is_settled", None)
    return is_settled() if is_settled is not None else future.done()
