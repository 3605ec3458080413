"""Calls and decode streams in flight to each worker, so that a worker's ejection cuts them short.

A P that freezes would keep the prefills sent to it until `--prefill-timeout`. Once the active
health checks eject it, `cut(worker)` ends every call waiting on it with `WorkerEjected` (an
`UpstreamError`), and the orchestrator retries the request like any failed prefill. A call
whose own request is cancelled (its client left) is cancelled as usual: the two never look alike.
Decode streams register a callback (`watch`): an ejection, or a drain with migration
(`cut(worker, "drain")`), calls it, and the stream moves to another worker
(proxy/journey/migration.py) where one can take it; a decode call or stream with nowhere to go
keeps waiting on its worker (a frozen D that thaws still answers), bounded by its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from proxy.upstream import WorkerEjected
from proxy.workers import Worker

T = TypeVar("T")


class InFlight:
    def __init__(self) -> None:
        # resolved on the worker's ejection, unless its `movable` (if any) says no
        self._waiting: dict[Worker, dict[asyncio.Future, Callable[[], bool] | None]] = {}
        self._streams: dict[Worker, set[Callable[[str], None]]] = {}  # called with the reason

    def num_calls(self, worker: Worker) -> int:
        return len(self._waiting.get(worker, ()))

    async def call(
        self, worker: Worker, call: Awaitable[T], movable: Callable[[], bool] | None = None
    ) -> T:
        """`call`'s result, or `WorkerEjected` as soon as the worker is ejected; with
        `movable`, only if it says the call has somewhere else to go at that moment."""
        task = asyncio.ensure_future(call)
        if not worker.is_healthy and (movable is None or movable()):  # ejected meanwhile
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _ejected(worker, worker.last_error)
        ejected = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(worker, {})
        waiting[ejected] = movable
        try:
            done, _ = await asyncio.wait((task, ejected), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the client left
            task.cancel()
            raise
        finally:
            waiting.pop(ejected, None)
            if not waiting and self._waiting.get(worker) is waiting:
                del self._waiting[worker]
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its connection closed
        raise _ejected(worker, ejected.result())

    def watch(self, worker: Worker, on_cut: Callable[[str], None]) -> Callable[[], None]:
        """Call `on_cut(reason)` when the worker is cut; returns the function that stops it."""
        streams = self._streams.setdefault(worker, set())
        streams.add(on_cut)

        def unwatch() -> None:
            streams.discard(on_cut)
            if not streams and self._streams.get(worker) is streams:
                del self._streams[worker]

        return unwatch

    def cut(self, worker: Worker, reason: str = "ejected") -> None:
        """The worker was ejected (or is drained by migration): end every call waiting on it,
        and tell every stream from it."""
        why = worker.last_error if reason == "ejected" else reason
        for ejected, movable in list(self._waiting.get(worker, {}).items()):
            if not ejected.done() and (movable is None or movable()):
                ejected.set_result(why)
        for on_cut in list(self._streams.get(worker, ())):  # each leaves when it closes
            on_cut(reason)


def _ejected(worker: Worker, why: str | None) -> WorkerEjected:
    if why == "drain":
        e = WorkerEjected(worker, f"{worker.role} worker {worker.url} is drained by migration")
        e.reason = "drain"
        return e
    return WorkerEjected(worker, f"{worker.role} worker {worker.url} was ejected ({why})")
