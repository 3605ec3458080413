"""The engine on its own thread, for asyncio servers.

The engine thread owns the `LLMEngine`: it builds it, takes commands (add, abort) from a queue,
steps while there is work and sleeps on an event when there is none, so the event loop never
runs a model forward. Outputs go back to each request's asyncio queue, one loop callback per step.

NOTE: every torch op of the process runs on this one thread, model loading included. With GNU
OpenMP, each thread that enters a parallel region gets its own worker team; once there are more
OpenMP threads than cores, idle workers stop spinning and a decode step runs ~30% slower.
`torch.set_num_threads` is per thread there too, so `num_threads` (the worker's --cpu-threads)
is set on this thread, once, before the engine is built; `self.num_threads` is what torch then
reports here. The process's core affinity is set earlier, at startup (common/cpu.py).

    async for out in engine.generate(request_id, prompt_token_ids, params): ...

Leaving the `async for` early (a client that went away) aborts the request and frees its blocks.

Arrivals: requests that reach a worker together (the hand-offs of one prefill batch, a client's
burst) get to its engine a few milliseconds apart, each after its own parsing and tokenizing on
the event loop. An idle engine that stepped on the first would run it alone and make the rest
wait for that step to end. So when nothing is running, the thread first waits, at most
`arrival_wait` seconds, while `on_the_way()` (the server's count of requests received and not
yet handed over) is above zero, then steps on all of them at once. A running batch never waits.

Fail closed: once the thread ends (a step raised, or `stop`), every request being generated,
every call still queued and every later call or request fails at once with `EngineDeadError`;
nothing waits forever. `on_death(error)` runs on the event loop when a failure ended it. A
tensor-parallel rank that exits ends the thread too: a step it was in fails, and an idle
engine is woken with a command that raises the rank's death.

KV events: with `engine.config.kv_events` on, the thread attaches a collector to the block pool
and publishes what the prefix cache recorded after every step (and after commands and transfer
polls while idle, which can evict or reset too) as one batch; the publisher is closed when
the thread ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError

from common.cpu import set_torch_threads
from common.engine.engine import LLMEngine
from common.engine.output import RequestOutput
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams
from common.engine.stats import EngineStats, engine_stats
from common.kv_cache.event_publisher import KVEventPublisher
from common.kv_cache.events import KVEventCollector

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served."""


class AsyncEngine:
    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        on_death: Callable[[BaseException], None] | None = None,
        num_threads: int | None = None,  # None: torch's default for a new thread
        on_the_way: Callable[[], int] | None = None,  # requests received, not yet added
        arrival_wait: float = 0.0,  # seconds an idle engine waits for them; 0: never
    ):
        self._factory = engine_factory
        self._on_death = on_death
        self._num_threads_wanted = num_threads
        self._on_the_way = on_the_way
        self._arrival_wait = arrival_wait
        self.num_threads: int | None = None  # torch's intra-op threads on the engine thread
        self.engine: LLMEngine | None = None
        self.kv_events: KVEventPublisher | None = None  # set when the engine is built
        # (command, its caller's future or None); guarded by _lock against _close
        self._commands: deque[tuple[Callable[[], None], Future | None]] = deque()
        self._lock = threading.Lock()
        self._closed_by: EngineDeadError | None = None  # set once: no command runs after it
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._end_with: Callable[[], BaseException] | None = None  # `end_all`
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._num_pending = 0  # added, not yet seen by the scheduler
        self.num_arrival_waits = 0  # idle steps that waited for requests on their way

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine on its thread and start stepping; raises what building raised."""
        self._loop = asyncio.get_running_loop()
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="engine", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(built)
        except asyncio.CancelledError:  # the thread stops once built (`_run`)
            self._stopping = True
            raise

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting + self._num_pending

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
        resume: Resume | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; ValueError for bad input. `resume`: a
        choice another worker started (`LLMEngine.add_request`)."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        if self._end_with is not None:
            raise self._end_with()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._num_pending += 1
            added = self._call(self._add, request_id, prompt, params, kv_transfer_params, resume)
            await asyncio.wrap_future(added)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def end_all(self, make_error: Callable[[], BaseException]) -> None:
        """Every request being generated, and every later one, ends with `make_error()` raised
        by its `generate`, which aborts it (its blocks freed). On the event loop: a worker
        that hands its streams to another one (`--drain-migrate`)."""
        self._end_with = make_error
        for queue in self._queues.values():
            queue.put_nowait(make_error())

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort_request(request_id), None)

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread between steps (e.g. to read engine state)."""
        return self._call(fn, *args)

    # -- the engine thread ------------------------------------------------------------------------
    def _call(self, fn: Callable, *args) -> Future:
        """`fn` runs on the engine thread even if the caller stops waiting (a client that goes
        away cancels the future): whatever it did, the caller's clean-up (an abort) follows it.
        The future fails with `EngineDeadError` if the thread ends before `fn` runs."""
        fut: Future = Future()

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 — handed to the awaiting caller
                _settle(fut.set_exception, e)
            else:
                _settle(fut.set_result, result)

        self._submit(run, fut)
        return fut

    def _submit(self, command: Callable[[], None], fut: Future | None) -> None:
        with self._lock:
            if self._closed_by is None:
                self._commands.append((command, fut))
                self._wake.set()
                return
        if fut is not None:
            _settle(fut.set_exception, self._closed_by)

    def _close(self, error: EngineDeadError) -> None:
        """No command runs from now on: those still queued fail with `error`, later ones too."""
        with self._lock:
            self._closed_by = error
            queued, self._commands = self._commands, deque()
        for _, fut in queued:
            if fut is not None:
                _settle(fut.set_exception, error)

    def _run(self, built: Future) -> None:
        try:
            self.num_threads = set_torch_threads(self._num_threads_wanted)
            self.engine = self._factory()
            self.engine.watch_ranks(lambda error: self._submit(_raiser(error), None))
            self._start_kv_events()
        except BaseException as e:  # noqa: BLE001 — handed to start()
            self.error = e
            self._release()
            _settle(built.set_exception, e)
            return
        if not _settle(built.set_result, None):  # start() was cancelled: nobody will step it
            self._release()
            return
        try:
            self._loop_until_stopped()
        except BaseException as e:  # noqa: BLE001 — every waiting request must hear of it
            logger.exception("engine thread failed")
            self.error = e
            self._close(EngineDeadError(f"engine failed: {e!r}"))
            self._loop.call_soon_threadsafe(self._fail_all, self._closed_by, e)
        finally:
            self._close(self._closed_by or EngineDeadError("the engine has stopped"))
            self._release()

    def _release(self) -> None:
        """Close what the engine thread opened: the connector, the KV events publisher, the
        tensor-parallel ranks."""
        if self.engine is not None:
            self.engine.shutdown(failed=self.error is not None)
        connector = self.engine.connector if self.engine is not None else None
        if connector is not None and hasattr(connector, "close"):
            connector.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def _loop_until_stopped(self) -> None:
        while not self._stopping:
            is_idle = not self.engine.scheduler.running
            self._drain_commands()
            if self.engine.has_unfinished_requests():
                if is_idle:
                    self._wait_for_arrivals()
                self._step()
                continue
            self.engine.poll_transfers()  # notifications and leases, while idle
            self._publish_kv_events()
            self._refresh_stats()
            if self.engine.has_unfinished_requests():  # pushed KV just landed
                continue
            self._wake.wait(0.01 if self.engine.has_pending_transfers() else None)
            self._wake.clear()

    def _wait_for_arrivals(self) -> None:
        """Nothing is running: let the requests already on their way join this first step."""
        if not self._arrival_wait or self._on_the_way is None or not self._on_the_way():
            return
        self.num_arrival_waits += 1
        deadline = time.monotonic() + self._arrival_wait
        while self._on_the_way() and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # NOTE: woken by each add; polled too, since a request can fail before its add
            self._wake.wait(min(left, 0.001))
            self._wake.clear()
            self._drain_commands()

    def _step(self) -> None:
        self._publish(self.engine.step())
        self._publish_kv_events()

    def _start_kv_events(self) -> None:
        cfg = self.engine.config.kv_events
        if cfg.is_enabled:
            self.kv_events = KVEventPublisher(cfg)
            self.engine.pool.events = KVEventCollector(self.engine.config.cache.block_size)

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.pool.take_events())

    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None,
        resume: Resume | None,
    ) -> None:
        self._num_pending -= 1
        self.engine.add_request(request_id, prompt, params, kv_transfer_params, resume)

    def _drain_commands(self) -> None:
        while self._commands:
            command, _ = self._commands.popleft()
            command()
        self._refresh_stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._refresh_stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, error: EngineDeadError, cause: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        if self._on_death is not None:
            self._on_death(cause)

    def _refresh_stats(self) -> None:
        self.stats = engine_stats(self.engine, self.kv_events)


def _raiser(error: BaseException) -> Callable[[], None]:
    def command() -> None:
        raise error

    return command


def _settle(setter: Callable, value) -> bool:
    """False where the future was cancelled and refused `value`."""
    # NOTE: a cancelled future refuses a result; letting that raise killed the engine thread
    try:
        setter(value)
    except InvalidStateError:
        return False
    return True
