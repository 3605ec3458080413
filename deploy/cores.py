"""The CPU plan of one machine: which worker runs on which cores, with how many torch threads.

    plan = plan_cores(num_prefill=1, num_decode=1, cores=[0, 1])
    plan.workers["prefill-0"].cores == (0,); plan.workers["decode-0"].cores == (1,)

Workers that share a machine must not share cores: each would start one torch thread per core,
and two such processes on the same cores run far slower than either alone. So the cores are
split into contiguous runs, one per worker (prefill workers first; an uneven split gives the
earlier workers one core more), each with one thread per core. The proxy is light and unpinned.

A tensor-parallel worker (`prefill_tp`/`decode_tp` N > 1) runs N ranks, each of which takes
its own run of the worker's cores (common.cpu.split_budget): the split counts it as N workers
and gives it their N runs together, so it gets N times a TP = 1 worker's share, at least N
cores where there are enough; with fewer, a worker's ranks share its cores before two workers
share one.

With more workers (ranks) than cores some must share: the plan says so in `warnings`, still
keeps prefill and decode workers on different cores whenever there are two cores or more (each
role gets a share of cores in proportion to its ranks), and within a role deals its cores out
one per rank, round robin. deploy/local.py passes the plan as --cpu-cores/--cpu-threads; deploy/
compose.py as each service's `cpuset` and --cpu-threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.cpu import format_cpu_list


@dataclass(frozen=True)
class WorkerCpu:
    cores: tuple[int, ...]
    num_threads: int

    @property
    def cpu_list(self) -> str:
        return format_cpu_list(self.cores)

    def worker_args(self) -> list[str]:
        return ["--cpu-cores", self.cpu_list, "--cpu-threads", str(self.num_threads)]

    def describe(self) -> str:
        cores, threads = "s" * (len(self.cores) != 1), "s" * (self.num_threads != 1)
        return f"core{cores} {self.cpu_list}, {self.num_threads} thread{threads}"


@dataclass(frozen=True)
class CpuPlan:
    workers: dict[str, WorkerCpu]  # by worker name: prefill-0, ..., decode-0, ...
    warnings: list[str] = field(default_factory=list)


def _split(items: list[int], num_parts: int) -> list[list[int]]:
    """Contiguous runs as even as can be, the longer ones first."""
    size, extra = divmod(len(items), num_parts)
    runs, start = [], 0
    for i in range(num_parts):
        end = start + size + (i < extra)
        runs.append(items[start:end])
        start = end
    return runs


def _deal(cores: list[int], num_workers: int) -> list[list[int]]:
    """One run per worker when there are enough cores, else one core each, round robin."""
    if num_workers <= len(cores):
        return _split(cores, num_workers)
    return [[cores[i % len(cores)]] for i in range(num_workers)]


def _role_shares(num_prefill: int, num_decode: int, num_cores: int) -> tuple[int, int]:
    """Cores for the prefill workers and for the decode workers (they overlap only when
    there is a single core)."""
    num_workers = num_prefill + num_decode
    if num_workers <= num_cores:
        sizes = [len(run) for run in _split(list(range(num_cores)), num_workers)]
        return sum(sizes[:num_prefill]), sum(sizes[num_prefill:])
    if num_prefill == 0 or num_cores == 1:
        return min(num_prefill, 1) * num_cores, num_cores
    prefill = min(max(round(num_cores * num_prefill / num_workers), 1), num_cores - 1)
    return prefill, num_cores - prefill


def plan_cores(
    num_prefill: int, num_decode: int, cores: list[int], prefill_tp: int = 1, decode_tp: int = 1
) -> CpuPlan:
    """Split `cores` among the workers of one machine (see the module's docstring)."""
    assert cores, "a machine has at least one core"
    assert prefill_tp >= 1 and decode_tp >= 1, "a worker has at least one rank"
    cores = sorted(cores)
    num_ranks = {"prefill": num_prefill * prefill_tp, "decode": num_decode * decode_tp}
    num_p, num_d = _role_shares(num_ranks["prefill"], num_ranks["decode"], len(cores))
    workers: dict[str, WorkerCpu] = {}
    for role, count, tp, role_cores in (
        ("prefill", num_prefill, prefill_tp, cores[:num_p]),
        ("decode", num_decode, decode_tp, cores[-num_d:]),
    ):
        if not count:
            continue
        if count * tp <= len(role_cores):  # a run per rank: a worker's runs together are one
            runs = _split(role_cores, count * tp)
            runs = [sum(runs[i * tp : (i + 1) * tp], []) for i in range(count)]
        else:  # a worker's ranks share its cores before two workers share one
            runs = _deal(role_cores, count)
        for i, run in enumerate(runs):
            workers[f"{role}-{i}"] = WorkerCpu(tuple(run), len(run))
    num_workers = num_prefill + num_decode
    return CpuPlan(workers, _warnings(num_workers, sum(num_ranks.values()), len(cores), workers))


def _warnings(
    num_workers: int, num_ranks: int, num_cores: int, workers: dict[str, WorkerCpu]
) -> list[str]:
    if num_ranks <= num_cores:
        return []
    on_cores = f"on {num_cores} core{'s' * (num_cores != 1)}"
    if num_ranks == num_workers:
        warnings = [f"{num_workers} workers {on_cores}: some workers share a core"]
    else:
        warnings = [
            f"{num_workers} worker{'s' * (num_workers != 1)} ({num_ranks} tensor-parallel "
            f"ranks in all) {on_cores}: some ranks share a core"
        ]
    warnings[0] += " and slow each other down"
    prefill = {c for name, w in workers.items() if name.startswith("prefill") for c in w.cores}
    decode = {c for name, w in workers.items() if name.startswith("decode") for c in w.cores}
    if shared := prefill & decode:
        warnings.append(f"prefill and decode workers share core {format_cpu_list(shared)}")
    return warnings
