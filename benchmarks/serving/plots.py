"""PNG plots of a run (matplotlib, the `bench` extra): `latency_cdf.png` (the CDF of each of
TTFT, TPOT, ITL, E2EL) and `throughput.png` (output token chunks per second over the run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.serving.client import RequestRecord
from benchmarks.serving.metrics import LATENCY_METRICS, latency_values, output_tokens_per_second


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(records: list[RequestRecord], out_dir: str | Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_latency_cdfs(records, out_dir, title), _throughput(records, out_dir, title)]


def _latency_cdfs(records: list[RequestRecord], out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    values = latency_values(records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        ms = np.sort(np.asarray(values[name]) * 1000.0)
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs {title}".strip())
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput(records: list[RequestRecord], out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    per_second = output_tokens_per_second(records)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(np.arange(len(per_second)), per_second, drawstyle="steps-post")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output token throughput {title}".strip())
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
