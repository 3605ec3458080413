"""common/native/choice.py: the faster candidate per shape class, recorded for /health and
/metrics; an injected clock stands for the kernels' times."""

from __future__ import annotations

import pytest

from common.native import choice


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, seconds: list[float]):
        """A candidate whose successive calls take these times (the last one repeats)."""
        times = iter(seconds)
        last = [seconds[-1]]

        def run():
            last[0] = next(times, last[0])
            self.now += last[0]

        return run


def test_the_lowest_median_wins_and_is_recorded():
    clock = Clock()
    # "c" has one slow outlier round: its median still wins
    candidates = {
        "torch": clock.costing([1.0, 3e-3]),  # a slow warm-up, then 3 ms
        "c": clock.costing([1.0, 2e-3, 2e-3, 9e-3, 2e-3, 2e-3]),
    }
    assert choice.choose("t-kernel", "batch 1-4", candidates, clock=clock) == "c"
    (kept,) = [c for c in choice.choices() if c.kernel == "t-kernel"]
    assert kept.path == "c" and kept.timings_us == pytest.approx({"torch": 3e3, "c": 2e3})
    assert choice.summary()["t-kernel [batch 1-4]"] == "c"


def test_a_failing_candidate_is_left_out():
    clock = Clock()

    def broken():
        raise RuntimeError("the kernel refused")

    candidates = {"c": broken, "torch": clock.costing([1e-3])}
    assert choice.choose("t-broken", "any", candidates, clock=clock) == "torch"
    with pytest.raises(RuntimeError):
        choice.choose("t-broken", "alone", {"c": broken}, clock=clock)


def test_a_recorded_choice_says_why():
    choice.record("t-recorded", "any", "torch", "no C compiler")
    (kept,) = [c for c in choice.choices() if c.kernel == "t-recorded"]
    assert kept.describe() == "t-recorded [any]: torch (no C compiler)"
