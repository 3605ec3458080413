"""The GPU check's entry point on a CPU machine: without CUDA it says what it needs and exits 2;
with `--device cpu` it runs P/D pull and push over real NIXL on a tiny model and reports them
equal to colocated, with the KV really transferred (the script works before a GPU runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # a bound on a hang, not on speed: the CPU run takes ~55 s alone and went past 120 s on
    # a machine shared with other test runs
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    return subprocess.run(
        [sys.executable, "-m", "tests.gpu.check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the check would run")
def test_without_cuda_exits_2_and_says_how_to_run():
    r = run_check()
    assert r.returncode == 2, r.stderr
    assert "needs CUDA" in r.stderr
    assert "tests/gpu/README.md" in r.stderr and "--device cpu" in r.stderr
    assert r.stdout == ""


def test_cpu_run_passes_pull_and_push_with_kv_transferred(tmp_path):
    out = tmp_path / "check.json"
    r = run_check("--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary == json.loads(r.stdout)
    assert summary["passed"] and summary["device"] == "cpu"
    parts = summary["parts"]

    pd = parts["pd"]
    assert pd["status"] == "passed" and pd["problems"] == []
    moved = pd["kv_moved"]
    assert moved["pull"]["num_loads"] == pd["num_prompts"] > 0
    assert moved["pull"]["bytes_loaded"] > 0 and moved["pull"]["num_failed"] == 0
    assert moved["push"]["bytes_pushed"] > 0 and moved["push"]["num_failed"] == 0
    assert pd["blocks_back"] == {"prefill": True, "decode": True}

    graphs = parts["graphs"]  # decode graphs' buffers, uncaptured on a CPU
    assert graphs["status"] == "passed" and graphs["problems"] == [] and not graphs["captured"]
    assert graphs["tokens_equal"] and graphs["replays"] == {"2": 3, "4": 4}

    transfer = parts["transfer"]  # the bandwidth part runs its READs (here DRAM) and checks them
    assert transfer["status"] == "measured" and len(transfer["rows"]) == 2
    assert all(r["read_gbps"] > 0 and r["descriptors_a_layer"] == 2 for r in transfer["rows"])

    ordering = parts["ordering"]
    assert ordering["status"] == "passed"
    assert ordering["sequential"]["kv_moved"]["push"]["bytes_pushed"] > 0
    assert ordering["sequential"]["kv_moved"]["checksum_failures"] == 0
    assert ordering["burst_push"]["errors"] == {}

    tp = parts["tp"]  # TP 2 over gloo: the same greedy tokens as TP 1; tok/s of both
    assert tp["status"] == "passed" and tp["mismatched_prompts"] == [] and tp["num_prompts"] > 0
    assert all(tp["speed"][k]["rows"][0]["decode_tok_s"] > 0 for k in ("tp1", "tp2"))
    assert tp["speed"]["tp2"]["collectives"]["all_reduce"]["calls"] > 0

    for name in ("flash", "speed"):
        assert parts[name]["status"] == "skipped" and parts[name]["reason"]
