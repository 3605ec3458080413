"""Servers on loopback for tests and benchmarks, and the ports they listen on.

`ServerProcess` is one worker or proxy: started at once, `wait_ready` for /health (or /ready),
`metric` reads /metrics, `stop`/`restart` by signal. `free_port` is the one way the tree picks a
port for a server it starts later. Starting, waiting and killing are common/processes.py's: each
server leads its own session and dies with the process that started it (a test run killed
leaves no worker behind), and a kill reaches its whole group.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import processes
from common.processes import Child

TLS = processes.tls_context()

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port nothing is bound to, picked at random below the kernel's ephemeral range. The
    caller binds it later, in another process: a port in the ephemeral range could meanwhile
    go to any socket the kernel numbers itself (UCX's listeners, outgoing connections; a KV
    events endpoint once lost that race in CI), one below it only to another pick of this."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                s.bind(("0.0.0.0", port))  # every address: KV events bind tcp://*
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low range is full: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def child_env() -> dict[str, str]:
    """This process's environment for a server it starts from the tree: the tree importable,
    output unbuffered (its log shows each line when it is written)."""
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


class ServerProcess:
    """`python -m {role}_server` (or `-m proxy`) on loopback with `args`, its output in
    `log_path`; started at once, `wait_ready` waits for it."""

    def __init__(self, role: str, args: list[str], log_path: Path, port: int | None = None):
        self.role = role
        self.args = list(args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.write_bytes(b"")
        self.child = self._spawn()

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.popen

    def command(self) -> list[str]:
        module = "proxy" if self.role == "proxy" else f"{self.role}_server"
        return [sys.executable, "-m", module, "--port", str(self.port), *self.args]

    def _spawn(self) -> Child:
        return processes.spawn(
            self.role, self.command(), url=self.url, log_path=self.log_path, env=child_env(),
            cwd=ROOT,
        )  # fmt: skip

    def restart(self, sig: int = signal.SIGKILL) -> ServerProcess:
        """Stop the process (SIGKILL by default) and start a new one on the same port with the
        same arguments (a worker's new process has a new engine id); not waited for."""
        self.stop(sig)
        self.child = self._spawn()
        return self

    def wait_ready(self, timeout: float = 120.0, path: str = "/health") -> ServerProcess:
        try:
            processes.wait_ready(f"{self.url}{path}", timeout, self._check_running)
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.log()}") from None
        return self

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, default: float | None = None) -> float:
        return metric(self.url, name, default)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """`sig` to the server (SIGTERM drains it), up to `timeout` s for it to exit, then
        SIGKILL to its whole group; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.send_signal(signal.SIGCONT)  # a frozen process acts on it only once thawed
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
            self.child.send(signal.SIGKILL)  # itself if still running, and what it left behind
        return self.proc.wait()


def metric(url: str, name: str, default: float | None = None) -> float:
    """A sample from the server's /metrics: `name` or `name{label="value",...}` as exposed."""
    text = httpx.get(f"{url}/metrics", timeout=5, verify=TLS).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(name)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
