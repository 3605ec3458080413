"""The local cluster's child processes: started together, watched, stopped together.

Each child runs in its own session (so its own process group): a Ctrl-C in the terminal reaches
only the launcher, which then stops the children itself; and stopping a child signals its whole
group, so nothing it spawned is left behind. Stopping is SIGTERM to every group, a grace period
(the workers drain), then SIGKILL to the groups still alive. `Supervisor.stop` is idempotent and
also runs at exit; on Linux each child also gets SIGTERM if the launcher itself dies (SIGKILL
included), through the kernel's parent-death signal.

`ServerProcess` is one worker or proxy on loopback for tests and benchmarks: started at once,
`wait_ready` for /health (or /ready), `metric` reads /metrics, `stop`/`restart` by signal.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Child:
    """One started process: its name in the banner, its URL and its log file."""

    name: str
    url: str
    log_path: Path
    popen: subprocess.Popen = field(repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exit_code(self) -> int | None:
        return self.popen.poll()

    @property
    def is_running(self) -> bool:
        return self.exit_code is None

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that asks Linux to SIGTERM the child when its parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: no imports after it
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


class Supervisor:
    """Starts children, reports the first one that exits, and stops them all."""

    def __init__(self, env: dict[str, str], stop_grace_s: float = 40.0):
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.children: list[Child] = []
        self._is_forced = False
        self._pre_exec = _parent_death_signal()
        atexit.register(self.stop)

    def start(self, name: str, url: str, cmd: list[str], log_path: Path) -> Child:
        with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(
                cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._pre_exec,  # safe: the launcher starts no threads
            )
        child = Child(name, url, log_path, popen)
        self.children.append(child)
        return child

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if not c.is_running), None)

    def stop(self) -> None:
        """SIGTERM every child's group, wait up to the grace period, SIGKILL what is left.

        A second Ctrl-C (or SIGTERM) while waiting skips the rest of the grace period.
        """
        running = [c for c in self.children if c.is_running]
        if not running:
            return
        handlers = {sig: signal.signal(sig, self._force) for sig in STOP_SIGNALS}
        try:
            for child in running:
                _signal_group(child, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            while any(c.is_running for c in running) and not self._is_forced:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            for child in running:
                if child.is_running:
                    print(f"{child.name} did not stop in time: SIGKILL", file=sys.stderr)
                    _signal_group(child, signal.SIGKILL)
                    child.popen.wait()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _force(self, signum: int, frame: object) -> None:
        self._is_forced = True


def _signal_group(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, sig)  # the child leads its own group (start_new_session)


# -- one server on loopback, started and waited for (tests and benchmarks) ---------------------

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


class ServerProcess:
    """`python -m {role}_server` (or `-m proxy`) on loopback with `args`, its output in
    `log_path`; started at once, `wait_ready` waits for it."""

    def __init__(self, role: str, args: list[str], log_path: Path, port: int | None = None):
        self.role = role
        self.args = list(args)
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
