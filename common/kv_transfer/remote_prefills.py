"""`RemotePrefills`: the scheduler-side lifecycle of a request whose KV crosses workers, between
the engine's steps and behind the `KVConnector` contract.

D, a request whose prompt another worker computed (`add`):
- pull: it is scheduled at once; the connector reads its KV in its first step. A read that
  fails (or does not check out) is dropped from that step (`drop_failed_loads`);
- push: it waits until every layer of its reservation has landed, then claims the blocks,
  checks them (count and P's checksums) and is scheduled with its prompt computed; past
  `load_timeout`, or with a reservation gone, its KV is lost;
- a first token from P that already ends it: nothing to load, the remote side is given back.
Lost KV is recomputed locally or fails the request, by `failure_policy` (`_recomputes`: the one
place), whether it was lost after admission (`_lose`) or before, its peer unreachable
(`unreachable`, asked by the HTTP layer through the EngineClient).
P, a finished request whose KV is still being pushed: its output is held until the writes
settle (`hold_sending`), with an error if one failed.
Requests finished here, outside a step, are reported by the engine's next step (`take_ready`).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from common.config import TransferConfig
from common.kv_cache.block_pool import Block, BlockPool
from common.kv_transfer.base import KVConnector, KVLoss, Request
from common.kv_transfer.params import RemotePrefill

logger = logging.getLogger(__name__)


class RequestQueue(Protocol):
    """What `RemotePrefills` needs of the scheduler (common/engine/scheduler.py)."""

    def add_request(self, req: Request) -> None: ...

    def recompute(self, req: Request) -> None: ...

    def fail(self, req: Request, error: str) -> None: ...

    def stop_if_done(self, req: Request, token_id: int) -> bool: ...


class RemotePrefills:
    def __init__(
        self,
        connector: KVConnector | None,
        queue: RequestQueue,
        cfg: TransferConfig,
        block_size: int,
        pool: BlockPool,
    ):
        self.connector = connector  # None: colocated serving, nothing is remote
        self.queue = queue
        self.cfg = cfg
        self.block_size = block_size
        self.pool = pool
        self._awaiting: list[tuple[Request, float]] = []  # pushed KV still arriving; deadline
        self._sending: dict[str, Request] = {}  # P: finished, output held until its push settles
        self._ready: list[Request] = []  # finished outside a step, reported by the next one

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def take_ready(self) -> list[Request]:
        ready, self._ready = self._ready, []
        return ready

    # -- D: admission ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A request with `remote_prefill` set, its first token (if P sent one) appended."""
        remote = req.remote_prefill
        if remote.first_token_id is not None and self.queue.stop_if_done(
            req, remote.first_token_id
        ):  # nothing left to generate: no KV needed
            self.give_back(req)
            self._ready.append(req)
        elif remote.push_reservation_id:  # scheduled once every layer has landed
            self._awaiting.append((req, time.monotonic() + self.cfg.load_timeout))
        else:
            self.queue.add_request(req)

    def abort(self, req: Request) -> None:
        """D: a request ended before its KV was read (pull, still queued) or claimed (push)
        gives back what P or the reservation holds for it at once, not at the lease's expiry.
        Once its read is planned `remote_prefill` is None, and the read's own path notifies P."""
        self._sending.pop(req.request_id, None)
        self._awaiting = [(r, d) for r, d in self._awaiting if r is not req]
        self.give_back(req)

    def give_back(self, req: Request) -> None:
        """Free what the remote prefill holds for a request that will not read it."""
        remote, req.remote_prefill = req.remote_prefill, None
        if remote is None:
            return
        if remote.push_reservation_id:
            self.connector.release_reservation(remote.push_reservation_id)
        else:
            self.connector.notify_release(remote)

    # -- between steps ---------------------------------------------------------------------------
    def poll(self) -> None:
        if self.connector is not None:
            self.connector.poll()
            self._admit_pushed()
            self._release_sent()

    def _admit_pushed(self) -> None:
        """Schedule requests whose pushed KV has fully landed; past the deadline, lose it."""
        still = []
        for req, deadline in self._awaiting:
            rid = req.remote_prefill.push_reservation_id
            state = self.connector.reservation_state(rid)
            if state == "ready":
                self._claim(req, rid)
            elif state == "gone" or time.monotonic() > deadline:
                self.give_back(req)
                why = f"pushed KV did not fully arrive (reservation {rid} {state})"
                self._lose(req, KVLoss("push_incomplete", why))
            else:
                still.append((req, deadline))
        self._awaiting = still

    def _claim(self, req: Request, rid: str) -> None:
        res = self.connector.claim_reservation(rid)
        blocks = res.blocks
        loss = self._pushed_loss(req, rid, blocks, res.num_held)
        req.remote_prefill = None
        if loss is not None:  # fail closed: never decode from KV that did not check out
            self.pool.free(list(reversed(blocks)))
            return self._lose(req, loss)
        req.blocks = blocks
        req.num_computed_tokens = req.num_tokens - 1
        self.connector.count_loaded("push")
        self.queue.add_request(req)

    def _pushed_loss(
        self, req: Request, rid: str, blocks: list[Block], num_held: int
    ) -> KVLoss | None:
        """Why a claimed reservation's KV cannot be decoded from, or None: it must hold exactly
        the blocks of what P computed (a smaller one leaves the tail unwritten) and the ones P
        wrote (after the `num_held` this worker had cached) must match P's checksums. P
        computed the tokens known at admission: a resumed request's outputs so far are in its
        prompt there."""
        needed = -(-req.num_admitted_tokens // self.block_size)
        if len(blocks) != needed:
            why = f"reservation {rid} holds {len(blocks)} blocks, the prompt needs {needed}"
            return KVLoss("remote_blocks_mismatch", why)
        written = [b.block_id for b in blocks[num_held:]]
        why = self.connector.verify_pushed(req.remote_prefill, written)
        return None if why is None else KVLoss("checksum_mismatch", why)

    def _release_sent(self) -> None:
        """P: outputs of requests whose pushed KV has settled; an error if a write failed
        (the proxy then pulls or recomputes: never a reservation with holes in it)."""
        for request_id, why in self.connector.take_sent().items():
            req = self._sending.pop(request_id, None)
            if req is None:
                continue
            if why is not None:
                req.error = f"pushing the prompt's KV to the decode worker failed: {why}"
            self._ready.append(req)

    # -- after a forward -------------------------------------------------------------------------
    def drop_failed_loads(
        self, scheduled: list[tuple[Request, int]], sampled: dict
    ) -> list[tuple[Request, int]]:
        """The step's scheduled requests less those whose remote KV did not arrive: their
        sampled token is dropped and their blocks are never cached; lost by policy."""
        failed = self.connector.take_failed() if self.connector else {}
        if not failed:
            return scheduled
        for req, _ in scheduled:
            if req.request_id in failed:
                sampled.pop(req.request_id, None)
                self._lose(req, failed[req.request_id])
        return [(r, n) for r, n in scheduled if r.request_id not in failed]

    def hold_sending(self, changed: list[Request]) -> list[Request]:
        """P: a finished request whose KV is still being pushed answers once it has landed."""
        if self.connector is None:
            return changed
        for req in changed:
            if req.is_finished and self.connector.is_sending(req.request_id):
                self._sending[req.request_id] = req
        return [req for req in changed if req.request_id not in self._sending]

    # -- the failure policy ----------------------------------------------------------------------
    def unreachable(self, remote: RemotePrefill, why: str) -> bool:
        """Before admission: the worker that `remote` names could not be reached. True when
        the prompt (P: D's prefix) is to be computed here instead, counted as such; False when
        the request fails. A first token the client already has cannot be recomputed into the
        same stream."""
        if remote.prefix_only:
            loss = KVLoss("prefix_unreachable", why, from_prefix=True)
        else:
            loss = KVLoss("prefill_unreachable", why)
        streamed = remote.first_token_streamed and remote.first_token_id is not None
        if (streamed and not loss.from_prefix) or not self._recomputes(loss):
            return False
        what = "the prompt's prefix" if remote.prefix_only else "the prompt"
        logger.warning("%s: computing %s locally", loss, what)
        self.connector.count_recomputed(loss.reason)
        return True

    def _recomputes(self, loss: KVLoss) -> bool:
        """The policy: lost KV is computed here under `recompute`. A prefix P could not read
        from D (the reverse pull) is computed here whatever the policy: the read only saves
        work."""
        return self.cfg.failure_policy == "recompute" or loss.from_prefix

    def _lose(self, req: Request, loss: KVLoss) -> None:
        """Compute the prompt here, or fail the request with why, by the policy."""
        if self._recomputes(loss):
            logger.warning("%s: computing %s locally", loss, req.request_id)
            self.connector.count_recomputed(loss.reason)
            self.queue.recompute(req)
        else:
            why = f"the prompt's KV cache did not arrive from the prefill worker: {loss}"
            self.queue.fail(req, why)
            self._ready.append(req)
