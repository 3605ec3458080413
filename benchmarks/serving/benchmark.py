"""One load test end to end: send the samples as the config says, print vLLM's table, write the
result file and the plots. `benchmarks/serve.py` is its command line; studies call it
in-process (benchmarks/serving/sweep.py, benchmarks/studies/kv_routing.py)."""

from __future__ import annotations

import sys

from benchmarks.serving import plots, report
from benchmarks.serving.client import connected
from benchmarks.serving.config import BenchConfig
from benchmarks.serving.datasets import SampleRequest
from benchmarks.serving.metrics import compute_metrics
from benchmarks.serving.runner import run_benchmark


async def benchmark(cfg: BenchConfig, samples: list[SampleRequest], args: dict) -> dict:
    """Send `samples` as `cfg` says; print the table; write the result file and plots."""
    concurrency = cfg.load.max_concurrency
    async with connected(cfg, cfg.endpoint_type, concurrency) as (client, endpoint):
        model = endpoint.model
        burst = "Poisson process" if cfg.load.burstiness == 1.0 else "Gamma distribution"
        print(f"Model: {model}  Endpoint: {endpoint.url}  Requests: {len(samples)}")
        print(f"Traffic request rate: {cfg.load.request_rate}")
        print(f"Burstiness factor: {cfg.load.burstiness} ({burst})")
        print(f"Maximum request concurrency: {concurrency}", flush=True)
        run = await run_benchmark(client, endpoint, samples, cfg.load, cfg.seed)
    metrics = compute_metrics(run.records, run.duration, list(cfg.percentiles), cfg.slos_ms)
    print(
        report.format_table(
            metrics,
            list(cfg.percentile_metrics),
            list(cfg.percentiles),
            concurrency,
            cfg.load.request_rate,
        )
    )
    result = report.build_result(metrics, run, args, model, cfg)
    if cfg.result_file:
        report.write_result(cfg.result_file, result)
        print(f"Wrote {cfg.result_file}")
    if cfg.plot_dir:
        _plot(run.records, cfg.plot_dir, f"({model}, {cfg.endpoint_type})")
    return result


def _plot(records, plot_dir: str, title: str) -> None:
    if not plots.has_matplotlib():
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return
    for path in plots.write_plots(records, plot_dir, title):
        print(f"Wrote {path}")
