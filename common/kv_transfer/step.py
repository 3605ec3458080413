"""What the connector does in one engine step (`StepMeta`, built by the scheduler side and read
by the forward): the loads it planned, one `LoadPlan` per request whose KV is read or was
pushed, and the pushes (`PushPlan`, push.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_cache.block_pool import Block
from common.kv_transfer.holds import TransferGroup
from common.kv_transfer.params import RemotePrefill
from common.kv_transfer.push import PushPlan
from common.kv_transfer.staging import Staged


@dataclass
class LoadPlan:
    request_id: str
    remote: RemotePrefill
    blocks: list[Block]  # local blocks the reads land in
    remote_blocks: list[int]
    first_block: int = 0  # index in the request of blocks[0] (blocks before: local hits)
    failed: bool = False
    started_at: float = 0.0
    group: TransferGroup | None = None
    staged: Staged | None = None  # read into a staging buffer first (staging.py)

    @property
    def local_blocks(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class StepMeta:
    loads: list[LoadPlan] = field(default_factory=list)
    pushes: list[PushPlan] = field(default_factory=list)
