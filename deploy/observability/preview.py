"""The dashboard's panels drawn by matplotlib from Prometheus's answers: a picture, no Grafana.

    python -m deploy.observability.preview --prometheus http://127.0.0.1:9090 --minutes 5 \
        --out docs/observability-preview.png

Each panel of deploy/observability/dashboard.py becomes one plot: every query of the panel
evaluated over the last `--minutes` through Prometheus's `/api/v1/query_range`, with the
dashboard's variables set to every pool and process and `$__rate_interval` to `--rate-window`.
It is not Grafana's rendering (no units beyond the axis label, no legend values), only the same
queries' data, to see what the panels hold where no Grafana runs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import httpx

from deploy.observability import dashboard

COLUMNS = 4


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def query_range(url: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    params = {"query": expr, "start": start, "end": end, "step": step_s}
    r = httpx.get(f"{url}/api/v1/query_range", params=params, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def draw(url: str, minutes: float, window: str, out: Path) -> int:
    """Every panel into one PNG; returns how many panels had data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(row.title, p) for row in dashboard.ROWS for p in row.panels]
    end = time.time()
    start, step_s = end - minutes * 60, max(1.0, minutes * 60 / 240)
    num_rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(num_rows, COLUMNS, figsize=(COLUMNS * 5.2, num_rows * 3.1))
    num_with_data = 0
    for ax, (row, panel) in zip(axes.flat, panels):
        num_lines = 0
        for q in panel.queries:
            for series in query_range(
                url, dashboard.everything(q.expr, window), start, end, step_s
            ):
                times = [float(t) - end for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                ax.plot(times, values, label=legend(q.legend, series["metric"])[:40], lw=1.2)
                num_lines += 1
        num_with_data += num_lines > 0
        ax.set_title(f"{panel.title}  ({row})", fontsize=8)
        ax.set_xlabel("seconds before the end", fontsize=7)
        ax.set_ylabel(panel.unit, fontsize=7)
        ax.tick_params(labelsize=6)
        if num_lines:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "pdserve dashboard panels, rendered by deploy/observability/preview.py from the panels'"
        " PromQL (Prometheus query_range), not by Grafana",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=90)
    return num_with_data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.observability.preview")
    p.add_argument("--prometheus", required=True, help="Prometheus's base URL")
    p.add_argument("--minutes", type=float, default=5.0, help="how far back to plot (5)")
    p.add_argument("--rate-window", default="30s", help="what $__rate_interval stands for")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    a = p.parse_args(argv)
    num = draw(a.prometheus.rstrip("/"), a.minutes, a.rate_window, a.out)
    print(f"{a.out}: {num} panels with data", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
