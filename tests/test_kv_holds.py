"""Fail-closed bookkeeping without a network: blocks under transfer stay held until every
transfer touching them settles (quarantine), and a pushed reservation is complete only when
every chunk of every layer has landed."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np
import pytest

from common.kv_cache.block_pool import BlockPool
from common.kv_transfer.nixl import job as nixl_job
from common.kv_transfer.nixl.holds import TransferHolds
from common.kv_transfer.nixl.job import TransferJob
from common.kv_transfer.nixl.reservations import ReservationTable, parse_push_notif, push_notif


def running() -> Future:
    """A transfer already inside the transport: it cannot be cancelled any more."""
    future: Future = Future()
    assert future.set_running_or_notify_cancel()
    return future


def test_blocks_given_up_during_a_transfer_are_quarantined_until_it_settles():
    pool = BlockPool(8, enable_prefix_caching=False)
    holds = TransferHolds(pool)
    owned = pool.allocate(3)
    group = holds.hold(owned)
    late, cancelled = running(), Future()
    group.futures += [late, cancelled]
    assert holds.num_blocks_held == 3 and holds.num_quarantined == 0  # the request still owns them
    pool.free(owned)  # the request failed: it lets its blocks go
    assert holds.num_quarantined == 3
    assert pool.num_free_blocks == 5, "quarantined blocks must not be allocatable"
    cancelled.cancel()  # never started: settled
    assert holds.settle() == 0, "a transfer still in flight keeps the group"
    late.set_exception(ConnectionError("peer gone"))
    assert holds.settle() == 1
    assert holds.num_quarantined == 0 and holds.num_blocks_held == 0 and pool.is_all_free


def test_a_transfer_reported_failed_but_not_released_is_not_settled():
    class Aborting(Future):  # the transport failed it, NIXL has not let go of the handle yet
        settled = False

        def is_settled(self) -> bool:
            return self.settled

    pool = BlockPool(4, enable_prefix_caching=False)
    holds = TransferHolds(pool)
    blocks = pool.allocate(2)
    future = Aborting()
    future.set_exception(TimeoutError("deadline"))
    holds.hold(blocks).futures.append(future)
    pool.free(blocks)
    assert holds.settle() == 0 and holds.num_quarantined == 2
    future.settled = True
    assert holds.settle() == 1 and pool.is_all_free


def test_a_handle_nixl_keeps_settles_once_it_lets_go_and_is_logged_once(monkeypatch, caplog):
    class Handle:  # NIXL refuses to release a transfer it still runs
        state, released = "PROC", False

        def release(self) -> None:
            if self.state == "PROC":
                raise RuntimeError("NIXL_IN_PROG")
            self.released = True

    class Agent:
        def check_xfer_state(self, handle: Handle) -> str:
            return handle.state

    monkeypatch.setattr(nixl_job, "_UNSETTLED_WARN_S", 0.0)
    handle, agent = Handle(), Agent()
    job = TransferJob("WRITE", "d0", np.zeros((1, 3)), np.zeros((1, 3)), b"", None, 64)
    job.handle = handle
    assert not job.fail(TimeoutError("deadline"))  # the transport keeps it in its aborting list
    assert job.future.done() and not job.future.is_settled()
    with caplog.at_level(logging.WARNING, logger=nixl_job.__name__):
        assert not job.try_settle(agent) and not job.try_settle(agent)
    unsettled = [r for r in caplog.records if "has not settled" in r.getMessage()]
    assert len(unsettled) == 1 and "NIXL_IN_PROG" in unsettled[0].getMessage()
    handle.state = "ERR"
    assert job.try_settle(agent) and handle.released and job.future.is_settled()


def test_shared_blocks_count_once_and_stay_with_their_owner():
    pool = BlockPool(4, enable_prefix_caching=False)
    holds = TransferHolds(pool)
    blocks = pool.allocate(2)
    first, second = holds.hold(blocks), holds.hold(blocks[:1])
    first.futures.append(running())
    second.futures.append(running())
    assert holds.num_blocks_held == 2 and holds.num_quarantined == 0
    first.futures[0].set_result(None)
    second.futures[0].set_result(None)
    assert holds.settle() == 2
    assert pool.num_used_blocks == 2, "the owner's references are untouched"


def notify(table: ReservationTable, rid: str, layers: int, chunks: int, skip=()) -> None:
    for chunk in range(chunks):
        for layer in range(layers):
            if (layer, chunk) not in skip:
                table.on_notification(push_notif(rid, layer, chunk, chunk == chunks - 1))


@pytest.mark.parametrize("missing", [(0, 0), (2, 1), (1, 2)])
def test_a_reservation_with_a_missing_chunk_is_never_complete(missing):
    pool = BlockPool(16, enable_prefix_caching=False)
    table = ReservationTable(pool, num_layers=3, timeout=60)
    res = table.reserve(6)
    notify(table, res.reservation_id, layers=3, chunks=3, skip={missing})
    assert not table.is_complete(res.reservation_id)
    table.on_notification(push_notif(res.reservation_id, *missing, is_final=missing[1] == 2))
    assert table.is_complete(res.reservation_id)


def test_chunks_complete_in_any_order_and_released_incomplete_counts():
    pool = BlockPool(16, enable_prefix_caching=False)
    table = ReservationTable(pool, num_layers=2, timeout=60)
    res = table.reserve(4)
    for layer, chunk in [(1, 1), (0, 1), (1, 0)]:
        table.on_notification(push_notif(res.reservation_id, layer, chunk, chunk == 1))
    assert not table.is_complete(res.reservation_id)
    table.on_notification(push_notif(res.reservation_id, 0, 0, False))
    assert table.is_complete(res.reservation_id)
    other = table.reserve(2)
    table.on_notification(push_notif(other.reservation_id, 0, 0, True))
    assert table.release(other.reservation_id)
    assert table.num_incomplete == 1
    assert pool.num_used_blocks == 6, "an incomplete released reservation keeps its blocks"
    table.on_notification(push_notif(other.reservation_id, 1, 0, True))  # P's last write lands
    assert pool.num_used_blocks == 4


def test_push_notifications_round_trip_and_reject_the_old_format():
    assert parse_push_notif(push_notif("r1", 3, 7, True)) == ("r1", 3, 7, True)
    assert parse_push_notif(push_notif("r1", 0, 0, False)) == ("r1", 0, 0, False)
    with pytest.raises(ValueError):
        parse_push_notif(b"pushed:r1:3")  # one notification per layer, no chunk count
