"""`--workers N`: N proxy processes on one port, sharing nothing but their configuration.

One Python event loop tops out at one core; a Rust router uses every core. So the parent (this
module, light: it never imports the app) binds the public address N times with SO_REUSEPORT,
one listening socket per process (the kernel spreads new connections over them by address
hash), plus one private loopback socket per process, and starts each child as `python -m proxy`
with the same arguments but its secrets, its two sockets inherited, and in its environment the
secrets (`PDSERVE_API_KEY`, ...: a command line is readable by every user of the host) and
`PDSERVE_PROXY_PROCESS` (JSON: its index, its siblings' private URLs, a random peer token).

What stays per process, and what that costs (docs/design.md, "Proxy processes"): health checks
(N times the probes), outstanding counts (least-outstanding sees its own requests), prefix
tables, rate buckets and the concurrency queue (a limit holds per process). Admin changes are
applied where they land and sent on to every sibling, and a child started again takes its
siblings' view of the workers; `/metrics` merges the siblings' answers (proxy/siblings.py). The
parent forwards SIGTERM/SIGINT to every child it started (each drains as a single proxy does;
one that came during start-up stops the starting) and exits when all have, killing those still
running after a grace period; its status is 1 unless every child exited with 0 or of that
signal. A child that dies is started again on the same sockets (connections queued on its socket
wait for it), unless children keep dying. Starting, signalling and killing the children, and
their dying with the parent, are common/processes.py's `Supervisor`'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.cpu import available_cores
from common.processes import Child, Supervisor
from common.settings import Settings

ENV = "PDSERVE_PROXY_PROCESS"
MAX_RESTARTS = 5  # deaths within RESTART_WINDOW_S that stop the whole proxy (a crash loop)
RESTART_WINDOW_S = 60.0
POLL_S = 0.2
STOP_GRACE_S = 30.0  # after a stop signal: children still running then are killed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessInfo:
    """What a child is told: which one it is, its sockets, where its siblings listen."""

    index: int
    public_fd: int
    private_fd: int
    siblings: tuple[str, ...]  # every child's private URL, its own included (by index)
    token: str  # proves a call came from a sibling: no fan-out again, local metrics only
    restarted: bool = False  # started again after dying: catches up on its siblings' changes

    @classmethod
    def from_env(cls) -> ProcessInfo | None:
        raw = Settings.from_env().proxy_process
        if not raw:
            return None
        d = json.loads(raw)
        siblings = tuple(d["siblings"])
        restarted = d.get("restarted", False)
        return cls(d["index"], d["public_fd"], d["private_fd"], siblings, d["token"], restarted)

    @property
    def count(self) -> int:
        return len(self.siblings)

    @property
    def others(self) -> list[str]:
        return [url for i, url in enumerate(self.siblings) if i != self.index]

    def sockets(self) -> list[socket.socket]:
        return [socket.socket(fileno=self.public_fd), socket.socket(fileno=self.private_fd)]


def default_process_count() -> int:
    """The cores this process may use: its affinity mask, bounded by a cgroup CPU quota (a
    container's `cpus:` or a pod's CPU limit)."""
    cores = len(available_cores())
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def bind_sockets(host: str, port: int, count: int) -> tuple[int, list[socket.socket]]:
    """`count` listening-to-be sockets on one public (host, port), SO_REUSEPORT; port 0 picks
    one free port for all of them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        sockets.append(sock)
    return port, sockets


def _private_socket() -> socket.socket:
    """Listening already: a sibling's call to a child that is still starting (or being started
    again) waits in the backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


class ProxyProcesses:
    """Starts the children, forwards stop signals, restarts the dead, waits for all; the
    processes themselves are common/processes.py's `Supervisor`'s.

    `secret_env` are environment variables of the children (None: unset there): the command line
    they get (`argv`) holds none. Once a stop signal came, no child is started or started
    again, and those still running after `stop_grace_s` are killed."""

    def __init__(
        self,
        argv: list[str],
        host: str,
        port: int,
        count: int,
        secret_env: dict[str, str | None] | None = None,
        stop_grace_s: float = STOP_GRACE_S,
    ):
        self.argv = argv
        self.secret_env = secret_env or {}
        self.stop_grace_s = stop_grace_s
        self.port, self.public = bind_sockets(host, port, count)
        self.private = [_private_socket() for _ in range(count)]
        self.siblings = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.private]
        self.token = secrets.token_hex(16)
        self.supervisor = Supervisor(stop_grace_s=stop_grace_s)
        self.children: list[Child | None] = [None] * count
        self.deaths: list[float] = []
        self.stop_signal: int | None = None  # the signal forwarded to the children
        self.stop_deadline = math.inf
        self.failed = False  # children kept dying, or did not stop: the exit status says so

    def start(self, index: int, restarted: bool = False) -> None:
        public, private = self.public[index], self.private[index]
        info = {
            "index": index,
            "public_fd": public.fileno(),
            "private_fd": private.fileno(),
            "siblings": self.siblings,
            "token": self.token,
            "restarted": restarted,
        }
        env = {**os.environ, ENV: json.dumps(info)}
        for name, value in self.secret_env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        cmd = [sys.executable, "-m", "proxy", *self.argv]
        fds = (public.fileno(), private.fileno())
        self.children[index] = self.supervisor.start(
            f"proxy process {index}", cmd, env=env, pass_fds=fds
        )

    def stop(self, signum: int, _frame=None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.stop_deadline = time.monotonic() + self.stop_grace_s
        self.supervisor.signal_all(signum)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for i in range(len(self.children)):
            if self.stop_signal is not None:  # stopped while starting: start no more
                break
            self.start(i)
        logger.info(
            "%d proxy processes on port %d (pids %s)",
            len(self.children),
            self.port,
            [c.pid for c in self.children if c is not None],
        )
        while True:
            started = [c for c in self.children if c is not None]
            codes = [c.exit_code for c in started]
            if self.stop_signal is not None:
                if all(code is not None for code in codes):
                    return self._exit_status(codes)
                if time.monotonic() > self.stop_deadline:
                    self._kill()
            else:
                for i, code in enumerate(codes):
                    if code is not None:
                        self._restart(i, code)
            time.sleep(POLL_S)

    def _exit_status(self, codes: list[int]) -> int:
        """0 when every child exited cleanly: with 0, or of the stop signal itself (one that had
        not yet set up its handler). Killed by another signal (the OOM killer's SIGKILL, a
        crash) is a failure."""
        clean = (0, -self.stop_signal)
        return 1 if self.failed or any(code not in clean for code in codes) else 0

    def _kill(self) -> None:
        for child in self.supervisor.kill_running():
            logger.error("%s did not stop in %gs: killed", child.name, self.stop_grace_s)
        self.failed = True

    def _restart(self, index: int, code: int) -> None:
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(self.deaths) > MAX_RESTARTS:
            logger.error("proxy processes keep dying (the last with %d): stopping", code)
            self.failed = True
            self.stop(signal.SIGTERM)
            return
        logger.warning("proxy process %d exited with %d: starting it again", index, code)
        self.start(index, restarted=True)


def supervise(
    argv: list[str], secret_env: dict[str, str | None], host: str, port: int, count: int
) -> int:
    return ProxyProcesses(argv, host, port, count, secret_env).run()
