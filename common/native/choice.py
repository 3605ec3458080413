"""Which implementation each CPU kernel runs, chosen at start-up by a short measurement.

A C kernel is not faster on every CPU: its AVX-512 code is, where it runs; its AVX2 and plain
code may lose to torch's (oneDNN's, MKL's) on some shapes. So where a kernel has rivals, the
worker times them on its own shapes, on this CPU, before it serves, and keeps the faster one per
shape class: `choose(kernel, shape, candidates)`. Every choice is kept here for `/health`
("kernels"), the `pdserve_kernel_path` metric and the log, with the times that made it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROUNDS = 5  # timed rounds per candidate, interleaved, after one warm-up call each


@dataclass(frozen=True)
class Choice:
    kernel: str  # e.g. "decode_attention"
    shape: str  # the shape class, e.g. "batch 1-4"
    path: str  # what runs, e.g. "c-avx2" or "torch"
    timings_us: dict[str, float] = field(default_factory=dict)  # median per candidate
    reason: str = ""  # why, where nothing was timed

    def describe(self) -> str:
        if not self.timings_us:
            return f"{self.kernel} [{self.shape}]: {self.path} ({self.reason})"
        times = ", ".join(f"{name} {us:.0f} us" for name, us in self.timings_us.items())
        return f"{self.kernel} [{self.shape}]: {self.path} ({times})"


_lock = threading.Lock()
_choices: dict[tuple[str, str], Choice] = {}


def choose(
    kernel: str,
    shape: str,
    candidates: dict[str, Callable[[], object]],
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """Times each candidate (one warm-up call, then `rounds` calls interleaved with the others'),
    records the one with the lowest median and returns its name. A candidate that raises is
    out, with its error logged; if every one raises, the first one's error propagates."""
    assert candidates, "nothing to choose from"
    runs = {name: [] for name in candidates}
    for name, fn in list(candidates.items()):
        try:
            fn()  # warm-up: first-touch pages, caches, lazy init
        except Exception as e:  # noqa: BLE001 - a candidate that fails is no candidate
            if len(runs) == 1:
                raise
            logger.warning("%s [%s]: %s failed, left out: %s", kernel, shape, name, e)
            del runs[name]
    for _ in range(rounds):
        for name in runs:
            start = clock()
            candidates[name]()
            runs[name].append(clock() - start)
    medians = {name: statistics.median(times) * 1e6 for name, times in runs.items()}
    best = min(medians, key=medians.__getitem__)
    _keep(Choice(kernel, shape, best, medians))
    return best


def record(kernel: str, shape: str, path: str, reason: str) -> None:
    """A choice made without a measurement (one candidate only), and why."""
    _keep(Choice(kernel, shape, path, reason=reason))


def choices() -> list[Choice]:
    with _lock:
        return sorted(_choices.values(), key=lambda c: (c.kernel, c.shape))


def summary() -> dict[str, str]:
    """{"kernel [shape]": path}: what `/health` shows."""
    return {f"{c.kernel} [{c.shape}]": c.path for c in choices()}


def _keep(choice: Choice) -> None:
    with _lock:
        before = _choices.get((choice.kernel, choice.shape))
        _choices[(choice.kernel, choice.shape)] = choice
    if before is None or before.path != choice.path:
        logger.info("kernel %s", choice.describe())
