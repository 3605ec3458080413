"""Calls in flight to each worker, so that a worker's ejection cuts them short.

A P that freezes would keep the prefills sent to it until `--prefill-timeout`. Once the active
health checks eject it, `cut(worker)` ends every call waiting on it with `WorkerEjected` (an
`UpstreamError`), and the orchestrator retries the request like any failed prefill. A call
whose own request is cancelled (its client left) is cancelled as usual: the two never look alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from proxy.upstream import WorkerEjected
from proxy.workers import Worker

T = TypeVar("T")


class InFlight:
    def __init__(self) -> None:
        self._waiting: dict[Worker, set[asyncio.Future]] = {}  # resolved on the worker's ejection

    def num_calls(self, worker: Worker) -> int:
        return len(self._waiting.get(worker, ()))

    async def call(self, worker: Worker, call: Awaitable[T]) -> T:
        """`call`'s result, or `WorkerEjected` as soon as the worker is ejected."""
        task = asyncio.ensure_future(call)
        if not worker.is_healthy:  # ejected between being chosen and being called
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _ejected(worker, worker.last_error)
        ejected = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(worker, set())
        waiting.add(ejected)
        try:
            done, _ = await asyncio.wait((task, ejected), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the client left
            task.cancel()
            raise
        finally:
            waiting.discard(ejected)
            if not waiting and self._waiting.get(worker) is waiting:
                del self._waiting[worker]
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its connection closed
        raise _ejected(worker, ejected.result())

    def cut(self, worker: Worker) -> None:
        """The worker was ejected: end every call waiting on it."""
        for ejected in self._waiting.pop(worker, ()):
            if not ejected.done():
                ejected.set_result(worker.last_error)


def _ejected(worker: Worker, why: str | None) -> WorkerEjected:
    return WorkerEjected(worker, f"{worker.role} worker {worker.url} was ejected ({why})")
