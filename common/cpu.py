"""A worker's CPU budget: the cores it may run on and the torch threads it uses.

    budget = CpuBudget(cores=parse_cpu_list("0-1"), num_threads=2)  # ValueError if they don't fit
    pin_process(budget.effective_cores)        # at startup: every thread of the process, Linux only
    set_torch_threads(budget.effective_threads)  # on the engine thread, before the model is built

Unset, a budget is every core of the process's affinity mask (as `taskset` left it) and one
thread per core, or `OMP_NUM_THREADS` threads when that is set: what torch did before.

NOTE: `os.sched_setaffinity(0, ...)` pins the calling thread only; threads that already run keep
their mask (importing torch already started one), and only threads started later inherit it. So
`pin_process` pins every thread in /proc/self/task. Likewise `torch.set_num_threads` is per thread
under GNU OpenMP (the parallel backend of torch's CPU wheels): it must run on the engine thread,
the only thread of a worker that runs torch ops (common/engine/async_engine.py).

No torch import at module level: the deploy tools plan with `format_cpu_list` without it.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

from common.settings import Settings


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-1' or '0,2' or '0-3,8' (Linux's cpu-list syntax) → the core numbers."""
    cores: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(f"not a core list: {text!r} (e.g. 0-1 or 0,2)")
        first, last = int(m[1]), int(m[2] or m[1])
        if last < first:
            raise ValueError(f"not a core list: {text!r} ({part.strip()} runs backwards)")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def format_cpu_list(cores) -> str:
    """{0, 1, 2, 5} → '0-2,5' (what `taskset -c` and /proc/<pid>/status print)."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def available_cores() -> frozenset[int]:
    """The cores this process may run on now (its affinity mask)."""
    return frozenset(os.sched_getaffinity(0))


def _omp_num_threads() -> int | None:
    return Settings.from_env().omp_num_threads


@dataclass(frozen=True)
class CpuBudget:
    """`cores`: None means the process's current affinity mask; `num_threads`: None means one
    per core (or OMP_NUM_THREADS). Validated against the mask when built."""

    cores: frozenset[int] | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.num_threads}")
        if self.cores is None:
            return
        if not self.cores:
            raise ValueError("--cpu-cores names no core")
        allowed = available_cores()
        if not self.cores <= allowed:
            raise ValueError(
                f"--cpu-cores {format_cpu_list(self.cores)}: no core "
                f"{format_cpu_list(self.cores - allowed)} here; this process may use "
                f"{format_cpu_list(allowed)}"
            )

    @property
    def effective_cores(self) -> frozenset[int]:
        return self.cores if self.cores is not None else available_cores()

    @property
    def effective_threads(self) -> int:
        return self.num_threads or _omp_num_threads() or len(self.effective_cores)

    def describe(self) -> str:
        threads = self.effective_threads
        cores = self.effective_cores
        return (
            f"{threads} torch thread{'s' * (threads != 1)} on "
            f"core{'s' * (len(cores) != 1)} {format_cpu_list(cores)}"
        )


def split_budget(
    cores: frozenset[int], num_threads: int, num_parts: int
) -> list[tuple[frozenset[int], int]]:
    """`num_parts` shares (cores, threads) of a budget, one per tensor-parallel rank: runs of the
    sorted cores and the threads divided as evenly as they go, at least one of each per share
    (with fewer cores than shares, shares wrap around and overlap)."""
    ordered = sorted(cores)
    shares = []
    for part in range(num_parts):
        first, last = (len(ordered) * k // num_parts for k in (part, part + 1))
        own = ordered[first:last] or [ordered[part % len(ordered)]]
        threads = num_threads // num_parts + (part < num_threads % num_parts)
        shares.append((frozenset(own), max(1, threads)))
    return shares


def pin_process(cores: frozenset[int]) -> None:
    """Pin every thread of this process to `cores`; threads started later inherit it."""
    os.sched_setaffinity(0, cores)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def set_torch_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for the calling thread (None: leave them); returns what
    torch now reports for it."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def set_torch_interop_threads(num_threads: int) -> bool:
    """Size torch's inter-op pool (process-wide, at most once, before any inter-op work);
    False when it is too late. Eager decoding barely uses it, so too late is harmless."""
    import torch

    try:
        torch.set_num_interop_threads(num_threads)
    except RuntimeError:
        return False
    return True
