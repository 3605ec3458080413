"""Real worker processes on loopback for tests: start, wait for /health, stop (no orphans)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A worker runs in float32 unless its args name a dtype: the tests' bitwise comparisons
    (P/D vs colocated, server vs offline engine) hold across computation paths only in fp32,
    and `--dtype auto` is bf16 on CPUs with native bf16. It runs eager unless its args say
    `--no-enforce-eager`: a compile costs each worker 5-20 s of start-up on 2 cores, and the
    compiled path has its own tests (parity, P/D push)."""

    def __init__(self, role: str, args: list[str], log_path: Path, port: int | None = None):
        self.role = role
        self.args = list(args)
        if role != "proxy" and "--dtype" not in self.args:
            self.args += ["--dtype", "float32"]
        if role != "proxy" and "--no-enforce-eager" not in self.args:
            self.args.append("--enforce-eager")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 — closed in stop()
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        module = "proxy" if self.role == "proxy" else f"{self.role}_server"
        cmd = [sys.executable, "-m", module, "--port", str(self.port), *self.args]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def restart(self, sig: int = signal.SIGKILL) -> ServerProcess:
        """Stop the process (SIGKILL by default) and start a new one on the same port with the
        same arguments (a worker's new process has a new engine id); not waited for."""
        self.stop(sig)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 — closed in stop()
        self.proc = self._spawn()
        return self

    def wait_ready(self, timeout: float = 120.0, path: str = "/health") -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}{path}", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, default: float | None = None) -> float:
        """A sample from /metrics: `name` or `name{label="value",...}` as exposed."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.send_signal(signal.SIGCONT)  # a frozen process acts on it only once thawed
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


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
