"""Real worker processes on loopback for tests (deploy/processes.py's, with the tests' defaults),
and what tests read from them."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import httpx

from common.processes import Child
from deploy import processes
from deploy.processes import ROOT, child_env, free_port, wait_until
from tests.forkserver import ForkServer

__all__ = ["ROOT", "ServerProcess", "complete", "free_port", "kv_sources", "wait_until"]

PROXY_DRAIN_S = 2.0
# a worker's pool unless its args size it: ~11k blocks of the tiny llama, against the default
# 1 GiB's 87k, whose allocation and prefault cost each start ~3 s of CPU
TEST_KV_CACHE_MEMORY = "128MiB"
_POOL_FLAGS = ("--num-blocks", "--kv-cache-memory")


class ServerProcess(processes.ServerProcess):
    """A worker runs in float32 unless its args name a dtype: the tests' bitwise comparisons
    (P/D vs colocated, server vs offline engine) hold across computation paths only in fp32,
    and `--dtype auto` is bf16 on CPUs with native bf16. It runs eager unless its args say
    `--no-enforce-eager`: a compile costs each worker 5-20 s of start-up on 2 cores, and the
    compiled path has its own tests (parity, P/D push). Its KV pool is `TEST_KV_CACHE_MEMORY`
    unless its args size it. A proxy runs as one process unless its
    args say `--workers`: its per-process state (admission queue, outstanding counts) is what
    most proxy tests pin down; tests/test_proxy_processes.py covers several. A proxy gives the
    requests in flight 2 s on SIGTERM unless its args say `--drain-timeout` (its default is
    10 s): a stream a test left open does not hold the module's teardown that long."""

    def __init__(
        self,
        role: str,
        args: list[str],
        log_path: Path,
        port: int | None = None,
        *,
        fork: bool = True,
    ):
        self.fork = fork
        args = list(args)
        if role == "proxy" and "--workers" not in args:
            args += ["--workers", "1"]
        if role == "proxy" and "--drain-timeout" not in args:
            args += ["--drain-timeout", str(PROXY_DRAIN_S)]
        if role != "proxy" and "--dtype" not in args:
            args += ["--dtype", "float32"]
        if role != "proxy" and "--no-enforce-eager" not in args:
            args.append("--enforce-eager")
        if role != "proxy" and not any(a.startswith(_POOL_FLAGS) for a in args):
            args += ["--kv-cache-memory", TEST_KV_CACHE_MEMORY]
        super().__init__(role, args, log_path, port)

    def _spawn(self) -> Child:
        """Forked by this pytest process's fork server (tests/forkserver.py): the same program
        at ~4 s less CPU a start. `fork=False`: started by exec, as a user starts it, for a test
        that reads its /proc command line or environment (a forked child's are the server's)."""
        if not self.fork:
            return super()._spawn()
        popen = fork_server().start(self.command(), child_env(), ROOT, self.log_path)
        return Child(self.role, self.url, self.log_path, popen)


_fork_server: ForkServer | None = None
_fork_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This process's fork server, started at the first call (again if it has exited)."""
    global _fork_server
    with _fork_server_lock:
        if _fork_server is None or not _fork_server.is_running:
            log = Path(tempfile.gettempdir()) / f"pdserve-forkserver-{os.getpid()}.log"
            _fork_server = ForkServer(log)
        return _fork_server


def kv_sources(server: ServerProcess) -> dict[str, float]:
    """Where a decode worker's remote-prefill requests got their KV: `pull` and `push` (loaded
    over NIXL) and `recomputed` (every reason), from its /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    sources = {"pull": 0.0, "push": 0.0, "recomputed": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("pdserve_kv_loaded_requests_total{"):
            sources[name.split('mode="')[1].split('"')[0]] = float(value)
        elif name.startswith("pdserve_kv_recomputed_total{"):
            sources["recomputed"] += float(value)
    return sources


def complete(url: str, body: dict) -> dict:
    """POST /v1/completions to a worker or proxy at `url`; the answer, which must be a 200."""
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
