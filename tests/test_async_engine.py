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


def test_cancelled_calls_and_admissions_leave_the_engine_alive(tiny_model):
    model = ModelConfig(str(tiny_model("llama")))
    cfg = EngineConfig(model=model, cache=CacheConfig(num_blocks=32))

    async def scenario():
        engine = AsyncEngine(lambda: LLMEngine(cfg))
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
    model = ModelConfig(str(tiny_model("llama")))
    cfg = EngineConfig(model=model, cache=CacheConfig(num_blocks=32))

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
