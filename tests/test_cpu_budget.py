"""A worker's CPU budget (--cpu-cores, --cpu-threads): parsing and validation, and a real
worker that reports its budget and whose every thread is pinned to the cores it was given."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from common.api.cli import parse_args
from common.cpu import CpuBudget, format_cpu_list, parse_cpu_list

ALLOWED = frozenset(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "text, cores",
    [("0", {0}), ("0-1", {0, 1}), ("0,2", {0, 2}), ("0-2,5", {0, 1, 2, 5}), (" 3 , 1", {1, 3})],
)
def test_core_lists_parse_and_format_back(text, cores):
    assert parse_cpu_list(text) == cores
    assert parse_cpu_list(format_cpu_list(cores)) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "2-1", "0,,1", "0.5"])
def test_bad_core_lists_are_refused(text):
    with pytest.raises(ValueError, match="core list"):
        parse_cpu_list(text)


def test_unset_budget_is_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    budget = CpuBudget()
    assert budget.effective_cores == ALLOWED
    assert budget.effective_threads == len(ALLOWED)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert budget.effective_threads == 1, "OMP_NUM_THREADS is honoured, as torch did"
    assert CpuBudget(num_threads=3).effective_threads == 3, "the flag wins over it"


def test_flags_parse_into_the_server_config():
    core = min(ALLOWED)
    _, server = parse_args("decode", ["--cpu-cores", str(core), "--cpu-threads", "1"])
    assert server.cpu == CpuBudget(cores=frozenset({core}), num_threads=1)
    assert server.cpu.describe() == f"1 torch thread on core {core}"
    _, server = parse_args("prefill", [])
    assert server.cpu == CpuBudget()


@pytest.mark.parametrize(
    "role, args, budget",
    [
        ("prefill", [], 256),  # CPU prefill is compute-bound: small steps, prompts in order
        ("prefill", ["--device", "cuda"], 2048),
        ("decode", [], 2048),
        ("prefill", ["--max-num-batched-tokens", "4096"], 4096),
        ("decode", ["--max-num-batched-tokens", "64"], 64),
    ],
)
def test_a_steps_token_budget_by_role_and_device(role, args, budget):
    engine, _ = parse_args(role, args)
    assert engine.scheduler.max_num_batched_tokens == budget


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cpu-threads", "0"], "--cpu-threads must be >= 1, got 0"),
        (["--cpu-threads", "two"], "invalid int value"),
        (["--cpu-cores", "0-"], "not a core list"),
        (["--cpu-cores", "4096"], "--cpu-cores 4096: no core 4096 here; this process may use"),
    ],
)
def test_bad_budgets_exit_2_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args("decode", args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def cpus_allowed(status: Path) -> str:
    for line in status.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list in {status}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="affinity is Linux's")
def test_a_pinned_worker_reports_its_budget_and_every_thread_keeps_to_it(start_server, tiny_model):
    core = min(ALLOWED)
    args = ["--model", str(tiny_model("llama")), "--num-blocks", "32"]
    server = start_server("decode", *args, "--cpu-cores", str(core), "--cpu-threads", "1")
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert health["cpu"] == {"threads": 1, "cores": str(core)}
    assert server.metric("pdserve_cpu_threads") == 1
    assert server.metric("pdserve_cpu_cores") == 1
    assert f"cpu budget: 1 torch thread on core {core}" in server.log()
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}  # KV, tokenizer, OpenMP threads
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200

    proc = Path(f"/proc/{server.proc.pid}")
    assert cpus_allowed(proc / "status") == str(core)
    tasks = {t.name: cpus_allowed(t / "status") for t in (proc / "task").iterdir()}
    assert len(tasks) > 1 and set(tasks.values()) == {str(core)}, tasks
