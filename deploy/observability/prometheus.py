"""A Prometheus for a cluster on this machine: its scrape config and its command line.

`python -m deploy.local --prometheus PORT` starts one with the cluster (Debian's `prometheus`
binary, which deploy/setup.sh installs); tests/test_observability.py starts one the same way over
its own cluster. One scrape job per pool, named as compose and the Kubernetes ServiceMonitors name
them (pdserve-prefill, pdserve-decode, pdserve-proxy), which is what the dashboard's `$job`
selects. The pool is the job rather than a `role` target label: the metrics carry a `role` label
of their own (`pdserve_requests_total{role}`, the proxy's `{role}` of the pool it called), which a
target label of that name would rename to `exported_role`.

/metrics is open on every process (docs/security.md: no key, no cluster token), so the scrape
config carries no credentials. Prometheus keeps its data in the folder it is given; the launcher
gives it a fresh temporary one and removes it when the cluster stops.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlsplit

import yaml

JOB_PREFIX = "pdserve-"
BINARY = "prometheus"
INSTALL_HINT = (
    "Prometheus is not installed: `sudo apt-get install prometheus` (Debian, Ubuntu), or "
    "`bash deploy/setup.sh --no-run`, which installs it"
)


def find_binary() -> str | None:
    """Debian's prometheus on PATH (or in /usr/bin when PATH lacks it)."""
    return shutil.which(BINARY) or shutil.which(BINARY, path="/usr/bin:/usr/local/bin")


def job_name(pool: str) -> str:
    """`prefill` → `pdserve-prefill`."""
    return f"{JOB_PREFIX}{pool}"


def scrape_config(targets: dict[str, list[str]], interval_s: float) -> dict:
    """Prometheus's config: a job per pool (`targets`: pool → its processes' base URLs, or
    `dns://NAME:PORT` for every address NAME resolves to, as compose's scaled services)."""
    interval = f"{interval_s:g}s"
    jobs = [_job(pool, urls, interval) for pool, urls in targets.items() if urls]
    return {"global": {"scrape_interval": interval}, "scrape_configs": jobs}


def _job(pool: str, urls: list[str], interval: str) -> dict:
    job = {
        "job_name": job_name(pool),
        "metrics_path": "/metrics",
        "scrape_interval": interval,
        "scrape_timeout": interval,
    }
    static = [urlsplit(url).netloc for url in urls if not url.startswith("dns://")]
    names = [urlsplit(url) for url in urls if url.startswith("dns://")]
    if static:
        job["static_configs"] = [{"targets": static}]
    if names:  # one A lookup per name and port: every replica behind it
        job["dns_sd_configs"] = [
            {"names": [n.hostname], "type": "A", "port": n.port, "refresh_interval": interval}
            for n in names
        ]
    return job


def write_config(folder: Path, targets: dict[str, list[str]], interval_s: float) -> Path:
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape_config(targets, interval_s), sort_keys=False))
    return path


def command(binary: str, config: Path, data_dir: Path, host: str, port: int) -> list[str]:
    """Prometheus serving its UI and HTTP API on host:port, its TSDB in `data_dir`."""
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        "--storage.tsdb.retention.time=1d",
        f"--web.listen-address={host}:{port}",
        "--log.level=warn",
    ]
