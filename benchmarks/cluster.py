"""The benchmarks' clusters: deploy/cluster.py's starter under common/processes.py's supervisor,
with what a study needs around it (a lone worker to compare against, waiting that fails fast).

    with Bench("pd_vs_colocated") as bench:                 # logs in a fresh /tmp folder
        cluster = bench.cluster(LocalConfig(mode="pull", cores=(0, 1), ...))
        alone = bench.worker("colocated", "decode", ["--kv-connector", "none"], cores="0,1")
        bench.wait_ok(f"{cluster.proxy.url}/ready")

Every child gets `cluster_env()` (one internal token, fresh KV events keys) and dies with the
benchmark; leaving the block, or SIGTERM, stops them all. A helper, not a study: studies import
it, and no study imports another.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from common.processes import Child, Supervisor, wait_ready
from deploy.cluster import Cluster, LocalConfig, cluster_env, proxy_command, start_cluster
from deploy.processes import ROOT, free_port

__all__ = ["ROOT", "Bench", "Cluster", "LocalConfig", "free_port"]


class Bench:
    """One benchmark's children and their logs."""

    def __init__(self, name: str, log_dir: Path | None = None):
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"{name}_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(cluster_env(), stop_grace_s=10.0)

    def __enter__(self) -> Bench:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children on SIGTERM too
        return self

    def __exit__(self, *exc) -> None:
        self.sup.stop()

    def cluster(self, cfg: LocalConfig, name: str = "") -> Cluster:
        """P, D and the proxy as `cfg` says (not waited for: `wait_ready`); `name`: its logs
        in a folder of that name. NOTE: a second cluster starts once the first is ready, or
        its workers would pick the same free ports."""
        log_dir = self.log_dir / name if name else self.log_dir
        log_dir.mkdir(exist_ok=True)
        return start_cluster(cfg, self.sup, free_port(), log_dir)

    def proxy(self, name: str, cluster: Cluster, cfg: LocalConfig, args: list[str]) -> Child:
        """One more proxy in front of `cluster`'s workers: `cfg`'s, with `args` for its own."""
        port = free_port()
        urls = {role: cluster.urls(role) for role in cluster.workers}
        cmd = proxy_command(replace(cfg, proxy_args=tuple(args)), port, urls)
        return self.start(name, cmd, url=f"http://127.0.0.1:{port}")

    def worker(
        self, name: str, role: str, args: list[str], cores: str | None = None, threads: int = 0
    ) -> Child:
        """One worker alone, on a free port, pinned to `cores` ("0,1") when given, with
        `threads` torch threads (0: one a core)."""
        port = free_port()
        cmd = [sys.executable, "-m", f"{role}_server", "--port", str(port), *args]
        if cores is not None:
            cmd += ["--cpu-cores", cores]
        if threads:
            cmd += ["--cpu-threads", str(threads)]
        return self.start(name, cmd, url=f"http://127.0.0.1:{port}")

    def start(self, name: str, cmd: list[str], url: str = "", env: dict | None = None) -> Child:
        """Any other child (a vLLM server, a router, a stub), its output in the log folder;
        `env` replaces the cluster's environment for it."""
        log = self.log_dir / f"{name}.log"
        return self.sup.start(name, cmd, url=url, log_path=log, env=env, cwd=ROOT)

    def wait_ready(self, cluster: Cluster, timeout: float = 300.0) -> None:
        """Every worker's /health, then the proxy's /ready."""
        for child in cluster.children[1:]:
            self.wait_ok(f"{child.url}/health", timeout)
        self.wait_ok(f"{cluster.proxy.url}/ready", timeout)

    def wait_ok(self, url: str, timeout: float = 300.0) -> None:
        """Until `url` answers 200; exits when a child has exited or the time is up."""
        try:
            wait_ready(url, timeout, self.check_alive, interval_s=0.5)
        except TimeoutError as e:
            sys.exit(f"{e}; logs in {self.log_dir}")

    def check_alive(self) -> None:
        """Exit when a child has: a worker gone mid-study would fail every request after."""
        dead = [f"{c.name} ({c.exit_code})" for c in self.sup.children if not c.is_running]
        if dead:
            sys.exit(f"{', '.join(dead)} exited; logs in {self.log_dir}")

    def cpu_affinity(self) -> dict[str, list[int]]:
        """Each child's cores, as the kernel has them."""
        return {c.name: sorted(os.sched_getaffinity(c.pid)) for c in self.sup.running()}
