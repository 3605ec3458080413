"""A worker whose engine fails on purpose, for the fail-closed tests; production code has no hook.

    python -m tests.engine_fault STEP prefill_server --port N ...

runs the worker module as `python -m prefill_server --port N ...` would, with `LLMEngine.step`
raising `InjectedFaultError` on its STEP-th call (1-based): an exception in the engine thread,
which ends it as a real fault would. `FaultyWorker` is a `ServerProcess` started that way.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from common.engine.engine import LLMEngine
from tests.servers import ServerProcess


class InjectedFaultError(RuntimeError):
    """The engine step this module was told to fail."""


def fail_step(step: int) -> None:
    """`LLMEngine.step`'s `step`-th call in this process raises `InjectedFaultError`."""
    assert step >= 1, f"a step number is 1-based, got {step}"
    real_step = LLMEngine.step
    num_calls = 0

    def step_or_fail(self: LLMEngine):
        nonlocal num_calls
        num_calls += 1
        if num_calls == step:
            raise InjectedFaultError(f"engine step {step} fails (tests/engine_fault.py)")
        return real_step(self)

    LLMEngine.step = step_or_fail


class FaultyWorker(ServerProcess):
    """A worker (`role`, `args` as `ServerProcess`'s) whose engine fails its `step`-th step."""

    def __init__(self, role: str, args: list[str], log_path: Path, step: int):
        self.step = step
        super().__init__(role, args, log_path)

    def command(self) -> list[str]:
        python, _, module, *args = super().command()  # python -m MODULE ARGS
        return [python, "-m", "tests.engine_fault", str(self.step), module, *args]


def main() -> None:
    step, module, *args = sys.argv[1:]
    fail_step(int(step))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
