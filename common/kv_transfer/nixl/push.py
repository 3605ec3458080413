"""P, push mode: a prompt's KV written into a decode worker's reservation, chunk by chunk.

Each prefill step of a push request makes one chunk: the blocks that became full this step (all
that are left in the last step), so each block is written exactly once and late or reordered
WRITEs cannot overwrite each other. The leading blocks that D holds already (the target's
`num_held_blocks`, an earlier turn in D's prefix cache) are never written. The connector posts
one WRITE per layer per chunk from the decorator's on-exit hook; this table keeps the books:

- a chunk's local blocks are held (`TransferHolds`) until its WRITEs settle, so a request that
  finishes, is aborted or is preempted never lets another request overwrite them mid-copy;
- the step never waits for a WRITE: a finished request's output waits instead (`is_sending`),
  and `settle()` reports each finished push once all its WRITEs are done, with why it failed
  (any failed WRITE fails the push: D would have a hole; see reservations.py).

Engine thread only.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

from common.kv_transfer.base import Request
from common.kv_transfer.nixl.holds import TransferGroup, TransferHolds
from common.kv_transfer.params import PushTarget, push_target
from common.kv_transfer.transfers import DescriptorHistogram, SecondsHistogram
from common.tracing import RequestTimes

logger = logging.getLogger(__name__)


@dataclass
class PushPlan:
    request_id: str
    target: PushTarget
    group: TransferGroup  # the local blocks this chunk writes from, held until it settles
    remote_blocks: list[int]
    chunk: int
    is_final: bool  # the prompt completes this step
    staged: Any = None  # staging.Staged: written whole through a buffer in D's shard layout

    @property
    def local_blocks(self) -> list[int]:
        return [b.block_id for b in self.group.blocks]


@dataclass
class _Push:
    """One request's push across its prefill steps."""

    target: PushTarget
    num_blocks_sent: int = 0  # the request's leading blocks already in a chunk
    num_chunks: int = 0
    writes: list[Future] = field(default_factory=list)
    is_finished: bool = False  # the request is done; its output waits for the writes
    started_at: float = 0.0
    finished_at: float = 0.0
    times: RequestTimes | None = None  # the request's: `kv_transfer_ns` set once it settled
    started_ns: int = 0


@dataclass
class PushStats:
    num_bytes_pushed: int = 0
    num_push_failures: int = 0  # requests some of whose writes failed
    seconds_pushing: float = 0.0  # per request: from its first WRITE to its last one landing
    seconds_push_exposed: float = 0.0  # of that, after its prefill ended (not hidden by compute)
    descriptors_a_layer: DescriptorHistogram = field(default_factory=DescriptorHistogram)
    seconds_a_request: SecondsHistogram = field(default_factory=SecondsHistogram)


class PushTable:
    def __init__(self, holds: TransferHolds, block_size: int):
        self.holds = holds
        self.block_size = block_size
        self.stats = PushStats()
        self._pushes: dict[str, _Push] = {}
        self._settled: dict[str, str | None] = {}  # not yet taken: why each failed, or None

    def __len__(self) -> int:
        return len(self._pushes)

    def plan(self, req: Request, num_new: int) -> PushPlan | None:
        """This step's chunk of `req`, or None (not a push, or no block became full)."""
        target = push_target(req.kv_transfer_params)
        if target is None or req.num_output_tokens > 0:
            return None
        push = self._pushes.get(req.request_id)
        if push is None:  # the blocks D holds already are not written
            push = _Push(target, num_blocks_sent=target.num_held_blocks, times=req.times)
            self._pushes[req.request_id] = push
        end = req.num_computed_tokens + num_new
        is_final = end == req.num_tokens
        first = push.num_blocks_sent
        last = -(-end // self.block_size) if is_final else end // self.block_size
        if first >= last and not is_final:
            return None
        push.num_blocks_sent = max(first, last)
        plan = PushPlan(
            req.request_id,
            target,
            self.holds.hold(req.blocks[first:last]),
            target.block_ids[first:last],
            chunk=push.num_chunks,
            is_final=is_final,
        )
        push.num_chunks += 1
        return plan

    def add_write(self, plan: PushPlan, future: Future) -> None:
        """One layer's WRITE of a chunk, posted."""
        push = self._pushes[plan.request_id]
        push.started_at = push.started_at or time.perf_counter()
        push.started_ns = push.started_ns or time.time_ns()
        plan.group.futures.append(future)
        push.writes.append(future)

    def finish(self, request_id: str) -> None:
        """The request has its first token: report its push once every WRITE is done."""
        if (push := self._pushes.get(request_id)) is not None:
            push.is_finished, push.finished_at = True, time.perf_counter()

    def forget(self, request_id: str) -> None:
        """Nobody waits for this push any more (aborted); its WRITEs settle under the holds."""
        self._pushes.pop(request_id, None)

    def is_sending(self, request_id: str) -> bool:
        return request_id in self._pushes or request_id in self._settled

    def take_settled(self) -> dict[str, str | None]:
        settled, self._settled = self._settled, {}
        return settled

    def settle(self) -> None:
        """Finished pushes whose WRITEs are all done: their outcome, for `take_settled`."""
        for request_id, push in list(self._pushes.items()):
            if push.is_finished and all(f.done() for f in push.writes):
                del self._pushes[request_id]
                self._settled[request_id] = self._outcome(request_id, push)

    def _outcome(self, request_id: str, push: _Push) -> str | None:
        errors = [e for f in push.writes if (e := _error(f)) is not None]
        results = [f.result() for f in push.writes if not _error(f)]
        self.stats.num_bytes_pushed += sum(r.num_bytes for r in results)
        if results:  # each WRITE is one layer of one chunk
            descriptors = sum(r.num_descriptors for r in results) / len(results)
            self.stats.descriptors_a_layer.observe(descriptors)
        done = time.perf_counter()
        seconds = done - (push.started_at or done)
        self.stats.seconds_pushing += seconds
        self.stats.seconds_push_exposed += done - push.finished_at
        if not errors:
            if push.times is not None and push.started_ns:
                push.times.kv_transfer_ns = (push.started_ns, time.time_ns())
            self.stats.seconds_a_request.observe(seconds)
            return None
        self.stats.num_push_failures += 1
        why = f"{len(errors)} of {len(push.writes)} KV writes failed: {errors[0]!r}"
        logger.warning("KV push for %s failed: %s", request_id, why)
        return why


def _error(future: Future) -> BaseException | None:
    """A done Future's exception (a cancelled one's too), or None."""
    if future.cancelled():
        return CancelledError()
    return future.exception()
