"""P/D vs colocated on this machine's CPU cores: the DistServe experiment, small.

The same Poisson workload, swept over request rates, against two systems on the same two cores:

    pd          the proxy, one prefill worker (1 thread, pinned to core A) and one decode worker
                (1 thread, pinned to core B), KV over NIXL (pull); the client talks to the proxy
    colocated   one decode_server with `--kv-connector none` (2 threads, pinned to cores A and B);
                the client talks to it directly

The proxy and the benchmark client (this process) are not pinned: they float over both cores in
both systems. The cluster is deploy/cluster.py's (benchmarks/cluster.py), without KV events (one
P and one D leave KV-aware routing nothing to choose); the sweep is benchmarks/serving/sweep.py's.

    .venv/bin/python -m benchmarks.studies.pd_vs_colocated [--rates 0.5 1 2] [--num-prompts 20]

Writes the JSON (every point's aggregates, vLLM's key names), three PNGs (goodput, ITL p99 and
TTFT p99 against the rate) and prints a markdown table.
"""

from __future__ import annotations

import os
import time

from benchmarks.cluster import Bench, LocalConfig
from benchmarks.serving.sweep import Study, calibrate, parse_args, report, sweep

SYSTEMS = {"pd": "P/D (1 + 1 core)", "colocated": "colocated (2 cores)"}
TITLE = "P/D vs colocated: SmolLM2-135M, fp32, 2 CPU cores"
QUIET = ("--log-level", "warning")


def start_systems(bench: Bench, study: Study) -> dict[str, str]:
    """Start P, D, the proxy and the colocated worker; the URL each system is measured at."""
    a, b = study.cores
    model = ("--model", study.model) if study.model else ()
    cfg = LocalConfig(
        model=study.model,
        port=0,
        cores=(a, b),  # P on A, D on B, one thread each
        is_kv_events=False,
        worker_args=QUIET,
        proxy_args=QUIET,
    )
    cluster = bench.cluster(cfg)
    colocated_args = [*model, *QUIET, "--kv-connector", "none"]
    colocated = bench.worker("colocated", "decode", colocated_args, cores=f"{a},{b}", threads=2)
    bench.wait_ready(cluster)
    bench.wait_ok(f"{colocated.url}/health")
    return {"pd": cluster.proxy.url, "colocated": colocated.url}


def main() -> None:
    study = parse_args("pd_vs_colocated", __doc__)
    started, load_start = time.monotonic(), os.getloadavg()
    with Bench("pd_vs_colocated") as bench:
        urls = start_systems(bench, study)
        affinity = bench.cpu_affinity()
        single = calibrate(study, urls)
        points = sweep(study, urls, bench)
    report(study, started, load_start, affinity, single, points, SYSTEMS, name="pd_vs_colocated",
           title=TITLE)  # fmt: skip


if __name__ == "__main__":
    main()
