"""A rate sweep of systems serving the same Poisson workload: the machinery of the P/D studies
(benchmarks/studies/pd_vs_colocated.py, benchmarks/studies/pd_vs_vllm.py), which each only start
their systems.

Every system is up for the whole sweep (the idle one sleeps) and the points alternate between
them, so a noisy moment on a shared box hits all. Each rate point has its own seed, the same for
every system, so no prompt is a prefix-cache hit of an earlier point. Goodput counts the
requests that meet both the TTFT and the TPOT SLO. Before the sweep each system is warmed up and
timed alone (one request at a time): the `single_request` entry of the JSON. `report` writes the
JSON (every point's aggregates, vLLM's key names), three PNGs (goodput, ITL p99 and TTFT p99
against the rate) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.cluster import ROOT, Bench
from benchmarks.serving.benchmark import benchmark
from benchmarks.serving.config import BenchConfig
from benchmarks.serving.datasets import DatasetConfig, load_samples
from benchmarks.serving.runner import LoadConfig

COLUMNS = {  # result key → table header
    "request_throughput": "req/s",
    "request_goodput": "goodput",
    "median_ttft_ms": "TTFT p50",
    "p99_ttft_ms": "TTFT p99",
    "median_tpot_ms": "TPOT p50",
    "p99_tpot_ms": "TPOT p99",
    "p99_itl_ms": "ITL p99",
}
DROPPED_KEYS = ("requests", "server_metrics", "args")  # per-request detail: not kept


@dataclass(frozen=True)
class Study:
    rates: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
    num_prompts: int = 20
    input_len: int = 256
    output_len: int = 64
    ttft_slo_ms: float = 3000.0  # ~3x P/D's TTFT alone (the slower system)
    tpot_slo_ms: float = 200.0  # ~3x either system's TPOT alone
    request_timeout: float = 120.0
    seed: int = 0
    cores: tuple[int, int] = (0, 1)
    model: str | None = None
    json_path: Path = ROOT / "docs" / "results" / "pd_vs_colocated.json"
    img_dir: Path = ROOT / "docs" / "img"

    def __post_init__(self):
        if not self.rates or not all(0 < r < math.inf for r in self.rates):
            raise ValueError(f"--rates must be finite and > 0: {self.rates}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 2:
            raise ValueError("need --num-prompts >= 1, --input-len >= 1, --output-len >= 2")
        if self.cores[0] == self.cores[1]:
            raise ValueError(f"--cores needs two different cores: {self.cores}")

    def bench_config(self, url: str, seed: int, rate: float, num: int, **load) -> BenchConfig:
        return BenchConfig(
            base_url=url,
            request_timeout=self.request_timeout,
            num_prompts=num,
            seed=seed,
            dataset=DatasetConfig(
                random_input_len=self.input_len, random_output_len=self.output_len
            ),
            load=LoadConfig(request_rate=rate, show_progress=False, **load),
            slos_ms={"ttft": self.ttft_slo_ms, "tpot": self.tpot_slo_ms},
        )


def measure(cfg: BenchConfig) -> dict:
    """One `benchmarks.serve` run in-process (it prints vLLM's table); its aggregates."""
    samples = load_samples(cfg.dataset, cfg.num_prompts, False, cfg.seed)
    result = asyncio.run(benchmark(cfg, samples, {}))
    return {k: v for k, v in result.items() if k not in DROPPED_KEYS}


def calibrate(study: Study, urls: dict[str, str]) -> dict[str, dict]:
    """Warm each system up (4 requests, 2 at a time), then time 3 requests one at a time."""
    single = {}
    for system, url in urls.items():
        print(f"\n#### {system}: warm-up, then single requests", flush=True)
        measure(study.bench_config(url, study.seed + 1000, math.inf, 4, max_concurrency=2))
        single[system] = measure(
            study.bench_config(url, study.seed + 2000, math.inf, 3, max_concurrency=1)
        )
    return single


def sweep(study: Study, urls: dict[str, str], bench: Bench) -> dict[str, list[dict]]:
    """Every rate against both systems, alternating which goes first."""
    points: dict[str, list[dict]] = {system: [] for system in urls}
    for i, rate in enumerate(study.rates):
        order = list(urls) if i % 2 == 0 else list(urls)[::-1]
        for system in order:
            bench.check_alive()  # a worker gone mid-study would fail every request of a point
            load = os.getloadavg()[0]
            print(f"\n#### {system} at {rate} req/s (load average {load:.2f})", flush=True)
            cfg = study.bench_config(urls[system], study.seed + i, rate, study.num_prompts)
            points[system].append({"rate": rate, "load_avg_1m_before": load, **measure(cfg)})
    return points


def markdown_table(points: dict[str, list[dict]], labels: dict[str, str]) -> str:
    head = "| rate (req/s) | system | done/failed | " + " | ".join(COLUMNS.values()) + " |"
    lines = [head, "|---:|---|---:|" + "---:|" * len(COLUMNS)]
    rows = sorted(((p["rate"], s, p) for s, ps in points.items() for p in ps), key=lambda r: r[:2])
    for rate, system, p in rows:
        cells = [_cell(p[key], key.endswith("_ms")) for key in COLUMNS]
        done = f"{p['completed']}/{p['failed']}"
        lines.append(f"| {rate:g} | {labels[system]} | {done} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, is_ms: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if is_ms else f"{value:.2f}"


def write_plots(
    points: dict[str, list[dict]],
    study: Study,
    labels: dict[str, str],
    name: str,
    title: str,
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    study.img_dir.mkdir(parents=True, exist_ok=True)
    stem = study.img_dir / name
    slos = f"TTFT ≤ {study.ttft_slo_ms:g} ms and TPOT ≤ {study.tpot_slo_ms:g} ms"
    look = dict(labels=labels, title=title)
    return [
        _plot(points, "request_goodput", f"goodput (req/s meeting {slos})", f"{stem}_goodput.png",
              offered=True, **look),
        _plot(points, "p99_itl_ms", "ITL p99 (ms)", f"{stem}_itl_p99.png",
              slo=("TPOT SLO", study.tpot_slo_ms), **look),
        _plot(points, "p99_ttft_ms", "TTFT p99 (ms)", f"{stem}_ttft_p99.png",
              slo=("TTFT SLO", study.ttft_slo_ms), **look),
    ]  # fmt: skip


def _plot(points, key, ylabel, path, labels, title, offered=False, slo=None) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, ps in points.items():
        ys = [math.nan if p[key] is None else p[key] for p in ps]
        ax.plot([p["rate"] for p in ps], ys, marker="o", label=labels[system])
    rates = sorted({p["rate"] for ps in points.values() for p in ps})
    if offered:
        ax.plot(rates, rates, ls=":", color="gray", label="offered rate (the most possible)")
    else:
        ax.set_yscale("log")
        ax.axhline(slo[1], ls="--", color="gray", label=f"{slo[0]} ({slo[1]:g} ms)")
    ax.set_xlim(left=0)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def parse_args(name: str, description: str, argv: list[str] | None = None) -> Study:
    """The study's command line; its JSON goes to docs/results/`name`.json unless --json."""
    d = Study(json_path=ROOT / "docs" / "results" / f"{name}.json")
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--rates", type=float, nargs="+", default=list(d.rates), help="req/s")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts, help="per point")
    ap.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=d.output_len, help="output tokens")
    ap.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms)
    ap.add_argument("--tpot-slo-ms", type=float, default=d.tpot_slo_ms)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout, help="s")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--cores", type=int, nargs=2, default=list(d.cores), metavar=("A", "B"),
                    help="P on A, D on B, colocated on both")  # fmt: skip
    ap.add_argument("--model", help="HF folder (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=d.json_path)
    ap.add_argument("--img-dir", type=Path, default=d.img_dir)
    a = ap.parse_args(argv)
    try:
        return Study(tuple(a.rates), a.num_prompts, a.input_len, a.output_len, a.ttft_slo_ms,
                     a.tpot_slo_ms, a.request_timeout, a.seed, tuple(a.cores), a.model, a.json,
                     a.img_dir)  # fmt: skip
    except ValueError as e:
        ap.error(str(e))


def report(study, started, load_start, affinity, single, points, labels, **plot) -> None:
    """Write the study's JSON and plots, print its table; `plot`: write_plots' name and title."""
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "study": asdict(study),
        "systems": labels,
        "cpu_affinity": affinity,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "wall_s": time.monotonic() - started,
        "single_request": single,
        "points": points,
    }
    study.json_path.parent.mkdir(parents=True, exist_ok=True)
    study.json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\n{markdown_table(points, labels)}\n\nWrote {study.json_path}")
    for path in write_plots(points, study, labels, **plot):
        print(f"Wrote {path}")
    print(f"wall time {result['wall_s']:.0f} s; load average {load_start} → {os.getloadavg()}")
