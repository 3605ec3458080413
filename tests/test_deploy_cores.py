"""The CPU plan of one machine (deploy/cores.py), tensor-parallel workers' runs of cores too, and
how the local launcher uses it."""

from __future__ import annotations

import os

import pytest

from deploy.cluster import LocalConfig, worker_command
from deploy.cores import WorkerCpu, plan_cores


def cores_of(plan, prefix: str) -> set[int]:
    return {c for name, w in plan.workers.items() if name.startswith(prefix) for c in w.cores}


def test_two_cores_one_each():
    plan = plan_cores(1, 1, [0, 1])
    assert plan.workers == {"prefill-0": WorkerCpu((0,), 1), "decode-0": WorkerCpu((1,), 1)}
    assert plan.warnings == []


@pytest.mark.parametrize(
    "num_prefill, num_decode, num_cores",
    [(1, 1, 2), (1, 1, 3), (1, 1, 16), (2, 6, 8), (1, 3, 64), (0, 2, 4), (2, 2, 2), (3, 1, 2)],
)
def test_prefill_and_decode_never_share_a_core(num_prefill, num_decode, num_cores):
    plan = plan_cores(num_prefill, num_decode, list(range(num_cores)))
    assert len(plan.workers) == num_prefill + num_decode
    assert not cores_of(plan, "prefill") & cores_of(plan, "decode")
    for worker in plan.workers.values():
        assert worker.num_threads == len(worker.cores) >= 1
    if num_prefill + num_decode <= num_cores:
        every = [c for w in plan.workers.values() for c in w.cores]
        assert len(every) == len(set(every)), "no two workers share a core"
        assert set(every) == set(range(num_cores)), "every core is used"
        sizes = [len(w.cores) for w in plan.workers.values()]
        assert max(sizes) - min(sizes) <= 1, "an even split"
        assert plan.warnings == []


def test_more_workers_than_cores_share_evenly_and_warn():
    plan = plan_cores(1, 3, [4, 5])  # cores as the affinity mask names them
    assert plan.workers["prefill-0"].cores == (4,)
    assert [plan.workers[f"decode-{i}"].cores for i in range(3)] == [(5,), (5,), (5,)]
    assert plan.warnings == [
        "4 workers on 2 cores: some workers share a core and slow each other down"
    ]
    plan = plan_cores(0, 3, [0, 1])
    assert [w.cores for w in plan.workers.values()] == [(0,), (1,), (0,)]


def test_one_core_is_shared_by_everyone_and_said_so():
    plan = plan_cores(1, 1, [3])
    assert {w.cores for w in plan.workers.values()} == {(3,)}
    assert plan.warnings[-1] == "prefill and decode workers share core 3"


def test_the_launcher_passes_each_worker_its_budget():
    cfg = LocalConfig()
    plan = cfg.cpu_plan
    assert plan is not None and set(plan.workers) == {"prefill-0", "decode-0"}
    cmd = worker_command(cfg, "decode", 8200, plan.workers["decode-0"])
    cpu = plan.workers["decode-0"]
    assert cmd[-4:] == ["--cpu-cores", cpu.cpu_list, "--cpu-threads", str(cpu.num_threads)]
    assert LocalConfig(is_cpu_split=False).cpu_plan is None


def test_the_launcher_refuses_cpu_flags_for_every_worker_unless_told_not_to_split():
    with pytest.raises(ValueError, match="add --no-cpu-split"):
        LocalConfig(worker_args=("--cpu-threads", "1"))
    cfg = LocalConfig(worker_args=("--cpu-threads=1",), is_cpu_split=False)
    assert worker_command(cfg, "prefill", 8100, None)[-1] == "--cpu-threads=1"


@pytest.mark.parametrize(
    "num_prefill, num_decode, prefill_tp, decode_tp, num_cores",
    [(0, 1, 1, 2, 2), (1, 1, 1, 2, 3), (1, 2, 1, 2, 6), (2, 1, 3, 4, 16), (0, 3, 1, 2, 8)],
)
def test_a_tp_worker_gets_a_run_of_cores_per_rank(
    num_prefill, num_decode, prefill_tp, decode_tp, num_cores
):
    plan = plan_cores(num_prefill, num_decode, list(range(num_cores)), prefill_tp, decode_tp)
    assert len(plan.workers) == num_prefill + num_decode and plan.warnings == []
    for name, worker in plan.workers.items():
        tp = prefill_tp if name.startswith("prefill") else decode_tp
        assert len(worker.cores) >= tp, (name, worker)  # each rank a core of its own
        assert worker.num_threads == len(worker.cores)
        assert worker.cores == tuple(range(worker.cores[0], worker.cores[-1] + 1)), "one run"
    every = [c for w in plan.workers.values() for c in w.cores]
    assert len(every) == len(set(every)), "no two workers share a core"


def test_a_tp_worker_counts_as_its_ranks():
    plan = plan_cores(1, 1, list(range(6)), decode_tp=2)  # 3 ranks: 2 cores each
    assert plan.workers["prefill-0"].cores == (0, 1)
    assert plan.workers["decode-0"] == WorkerCpu((2, 3, 4, 5), 4)


def test_more_ranks_than_cores_share_and_say_so():
    plan = plan_cores(0, 1, [0, 1], decode_tp=4)
    assert plan.workers == {"decode-0": WorkerCpu((0, 1), 2)}
    assert plan.warnings == [
        "1 worker (4 tensor-parallel ranks in all) on 2 cores: some ranks share a core and slow "
        "each other down"
    ]
    plan = plan_cores(1, 1, [0, 1, 2], decode_tp=4)  # P and D still apart
    assert not cores_of(plan, "prefill") & cores_of(plan, "decode")
    assert plan.warnings[0].startswith("2 workers (5 tensor-parallel ranks in all) on 3 cores")


def test_the_launcher_passes_a_tp_worker_its_size_and_cores():
    cfg = LocalConfig(num_prefill=0, decode_tp=2, mode="colocated")
    cpu = WorkerCpu((0, 1), 2)
    cmd = worker_command(cfg, "decode", 8200, cpu)
    assert cmd[-6:] == ["--tensor-parallel-size", "2", *cpu.worker_args()]
    plan = cfg.cpu_plan
    assert plan is not None and set(plan.workers) == {"decode-0"}
    assert plan.workers["decode-0"].cores == tuple(sorted(os.sched_getaffinity(0)))  # all
    assert "--tensor-parallel-size" not in worker_command(LocalConfig(), "decode", 8200, cpu)
