"""One NIXL transfer, from submission to settled: the job the transfer thread (transport.py)
carries (`TransferJob`: the descriptors, NIXL's handle, the caller's Future) and the error a
failed one reports (`as_transfer_error`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.kv_transfer.transfers import TransferError, TransferFuture, TransferResult

logger = logging.getLogger(__name__)

_UNSETTLED_WARN_S = 10.0  # a handle NIXL keeps this long is logged (once)


@dataclass
class TransferJob:
    """One READ or WRITE of one layer's blocks with one peer, from submission to settled."""

    op: str  # "READ" | "WRITE"
    peer: str
    local_descs: np.ndarray  # (n, 3) rows of (addr, len, device id)
    remote_descs: np.ndarray
    notif: bytes
    deadline: float | None
    num_bytes: int
    ready: Any = None  # a CUDA event the data waits on, or None
    future: TransferFuture = field(default_factory=TransferFuture)
    handle: Any = None
    started: float = 0.0
    post_s: float = 0.0
    unsettled_since: float = 0.0  # when NIXL first refused to release the handle (monotonic)
    release_error: str = ""  # its last refusal, for the log
    warned: bool = False

    def finish(self) -> bool:
        """DONE: release the handle and report the result; True if settled (released)."""
        seconds = time.monotonic() - self.started
        settled = self.release()
        self.future.mark_settled(settled)
        result = TransferResult(self.num_bytes, seconds, len(self.local_descs), self.post_s)
        self.future.set_result(result)
        return settled

    def fail(self, exc: BaseException) -> bool:
        """Release the handle (aborting an in-flight transfer) and report `exc` unless the
        Future is done already; True if settled."""
        settled = self.release()
        self.future.mark_settled(settled)
        if not self.future.done():
            self.future.set_exception(exc)
        return settled

    def try_settle(self, agent: Any) -> bool:
        """A failed job whose handle NIXL refused to release: release it once the transfer is
        no longer in progress. True once settled; a job unsettled for `_UNSETTLED_WARN_S` is
        logged once (its blocks stay quarantined until NIXL lets go)."""
        try:
            state = agent.check_xfer_state(self.handle)
        except Exception:  # noqa: BLE001 — the peer is gone: nothing can move any more
            state = "ERR"
        if state != "PROC" and self.release(quiet=True):
            return True
        waited = time.monotonic() - self.unsettled_since
        if waited > _UNSETTLED_WARN_S and not self.warned:
            self.warned = True
            logger.warning(
                "a %s with %s has not settled for %.0f s: state %s, release refused with %s; "
                "its local blocks stay quarantined", self.op, self.peer, waited, state,
                self.release_error or "nothing (still in progress)",
            )  # fmt: skip
        return False

    def release(self, quiet: bool = False) -> bool:
        """Release the handle; False (handle kept) if NIXL refused. Settles the Future."""
        if self.handle is not None:
            try:
                self.handle.release()
            except Exception as e:
                if not quiet:
                    why = "releasing a %s handle with %s failed: %r"
                    logger.warning(why, self.op, self.peer, e)
                self.release_error = repr(e)
                self.unsettled_since = self.unsettled_since or time.monotonic()
                return False
            self.handle = None
        self.future.mark_settled()
        return True


def as_transfer_error(job: TransferJob, exc: Exception) -> Exception:
    """What a transfer's Future fails with: a timeout or a TransferError (NIXL's error as cause)."""
    if isinstance(exc, (TimeoutError, TransferError)):
        return exc
    error = TransferError(f"{job.op} with {job.peer} failed: {exc!r}")
    error.__cause__ = exc
    return error
