"""The engine thread outlives callers that stop waiting: a call whose caller was cancelled
(a client gone during admission) still runs, and the thread goes on serving."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.async_engine import AsyncEngine, EngineDeadError
from common.engine.engine import LLMEngine
from common.engine.sampling_params import SamplingParams


def _config(tiny_model) -> EngineConfig:
    model = ModelConfig(str(tiny_model("llama")))
    return EngineConfig(model=model, cache=CacheConfig(num_blocks=32))


@pytest.fixture(scope="module")
def shared_engine(tiny_model):
    """make() → the module's LLMEngine, built (and compiled: ~5 CPU-s) on the first call, in
    the engine thread of the AsyncEngine that asks for it: the tests that leave it idle, with
    every block free (each asserts it or runs its requests to the end), hand it on. The test
    whose step fails makes its own."""
    cfg, made = _config(tiny_model), []

    def make() -> LLMEngine:
        if not made:
            made.append(LLMEngine(cfg))
        engine = made[0]
        assert not engine.has_unfinished_requests() and engine.pool.is_all_free
        return engine

    return make


def test_cancelled_calls_and_admissions_leave_the_engine_alive(shared_engine):
    async def scenario():
        engine = AsyncEngine(shared_engine)
        await engine.start()
        try:
            gate = threading.Event()
            blocker = engine.call(gate.wait)  # holds the engine thread between steps
            ran = []
            cancelled = engine.call(lambda: ran.append(1) or 42)
            assert cancelled.cancel()  # what asyncio.wrap_future does when its awaiter goes
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            admission = asyncio.ensure_future(anext(engine.generate("gone", [5, 6, 7], params)))
            await asyncio.sleep(0.05)
            admission.cancel()  # the client left while its request was being added
            gate.set()
            await asyncio.wrap_future(blocker)
            outputs = [o async for o in engine.generate("after", [5, 6, 7], params)]
            assert engine.is_alive and outputs[-1].finished and ran == [1]
            pool = engine.engine.pool
            assert await asyncio.wrap_future(engine.call(lambda: pool.is_all_free))
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))  # a dead engine thread would hang here


def test_a_dead_engine_thread_fails_every_pending_and_later_call(tiny_model):
    """A step that raises ends the thread: the request being generated, a call queued while the
    step ran and any later call or request all fail with EngineDeadError instead of hanging."""
    cfg = _config(tiny_model)  # an engine of its own: its failed step leaves a request in it

    async def scenario():
        engine = AsyncEngine(lambda: LLMEngine(cfg))
        await engine.start()
        in_step, release = threading.Event(), threading.Event()

        def broken_step():
            in_step.set()
            release.wait()
            raise RuntimeError("injected step failure")

        engine.engine.step = broken_step
        try:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            running = asyncio.ensure_future(anext(engine.generate("r", [5, 6, 7], params)))
            await asyncio.to_thread(in_step.wait)
            queued = engine.call(lambda: 42)  # waits in the queue while the step fails
            release.set()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(asyncio.wrap_future(queued), 5)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(running, 5)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(asyncio.wrap_future(engine.call(lambda: 1)), 5)
            assert not engine.is_alive
        finally:
            release.set()
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


class Batches:
    """The requests of each step the engine ran (a spy on the real model runner)."""

    def __init__(self, engine: AsyncEngine):
        self.steps: list[list[str]] = []
        runner = engine.engine.runner
        execute = runner.execute

        def recording(scheduled, meta):
            self.steps.append(sorted(req.request_id for req, _ in scheduled))
            return execute(scheduled, meta)

        runner.execute = recording
        self.remove = lambda: delattr(runner, "execute")  # the runner's own again


async def _all(outputs) -> list:
    return [o async for o in outputs]


@pytest.mark.parametrize("arrival_wait", [30.0, 0.0])
def test_an_idle_engine_waits_for_requests_on_their_way(shared_engine, arrival_wait):
    """Request b is still being parsed (the server counts it as on its way) when a reaches an
    idle engine: with an arrival wait the first step runs both; with none, a alone."""
    on_the_way = [0]

    async def scenario():
        engine = AsyncEngine(
            shared_engine, on_the_way=lambda: on_the_way[0], arrival_wait=arrival_wait
        )
        await engine.start()
        batches = Batches(engine)
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            on_the_way[0] = 1  # "b"
            a = asyncio.ensure_future(_all(engine.generate("a", [5, 6, 7], params)))
            await asyncio.sleep(0.3)  # "a" is added: the engine steps on it, or waits
            b_outputs = engine.generate("b", [8, 9], params)
            b = asyncio.ensure_future(_all(b_outputs))
            await asyncio.sleep(0)  # b's add is queued (the server's hand-over is the same)
            on_the_way[0] = 0
            outputs = await asyncio.gather(a, b)
            assert all(out[-1].finished for out in outputs)
            return batches.steps, engine.num_arrival_waits
        finally:
            await engine.stop()
            batches.remove()

    steps, waits = asyncio.run(asyncio.wait_for(scenario(), 60))
    if arrival_wait:
        assert steps[0] == ["a", "b"] and waits == 1, steps
    else:
        assert steps[0] == ["a"] and waits == 0, steps


def test_the_arrival_wait_is_bounded_and_a_running_batch_never_waits(shared_engine):
    """A request whose arrival never completes (the count stuck above zero) delays an idle
    engine's step by at most the wait; while requests run, steps do not wait at all (with a
    wait of 20 s per step, 12 tokens would take minutes: the 60 s bound fails the test)."""
    on_the_way = [1]  # stuck: a request that never reaches the engine

    async def scenario():
        engine = AsyncEngine(shared_engine, on_the_way=lambda: on_the_way[0], arrival_wait=0.2)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            short = await _all(engine.generate("short", [5, 6, 7], params))
            assert short[-1].finished and engine.num_arrival_waits == 1
            engine._arrival_wait = 20.0  # from now on a wait would show
            on_the_way[0] = 0
            long = engine.generate("long", [5, 6], SamplingParams(max_tokens=12, ignore_eos=True))
            first = await anext(long)  # running now
            on_the_way[0] = 1
            rest = [o async for o in long]  # 11 steps with one request on its way
            assert first.outputs and rest[-1].finished and engine.num_arrival_waits == 1
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


class Draining(RuntimeError):
    pass


def test_end_all_ends_every_generation_and_frees_its_blocks(shared_engine):
    """`--drain-migrate`'s end: requests being generated raise the error at once (their blocks
    back in the pool), and so does any request that would still start."""

    async def scenario():
        engine = AsyncEngine(shared_engine)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            streams = [engine.generate(f"r{i}", [5, 6, 7, i + 3], params) for i in range(3)]
            for stream in streams:
                await anext(stream)  # each is running
            engine.end_all(Draining)
            for stream in streams:
                with pytest.raises(Draining):
                    async for _ in stream:
                        pass
            with pytest.raises(Draining):
                await anext(engine.generate("late", [5, 6, 7], params))
            pool = engine.engine.pool
            assert await asyncio.wrap_future(engine.call(lambda: pool.is_all_free))
            assert engine.is_alive and engine.num_unfinished == 0
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
