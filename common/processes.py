"""Child processes that are started together, watched, and stopped together, and never outlive
the process that started them.

The one process toolkit of the tree: deploy/local.py's cluster, the proxy's `--workers N`
(proxy/processes.py), the benchmarks and the tests' servers (deploy/processes.py) start their
children through `spawn` (a `Supervisor` when they are started and stopped together) and wait
for them through `wait_ready`. It lives here, under
the runtime's floor, because the proxy imports neither deploy/ nor torch and a tensor-parallel
rank (common/parallel/) needs the parent-death signal too; this module imports neither.

- **Own session.** Each child leads its own session (so its own process group): a Ctrl-C in the
  terminal reaches only the supervisor, which then stops the children itself, and signalling a
  child signals its whole group, so nothing it spawned is left behind.
- **Parent death.** On Linux each child gets a signal (SIGTERM) when the supervisor dies,
  SIGKILL included (`die_with_parent`, the kernel's PR_SET_PDEATHSIG).
- **Signals held while starting.** Stop signals wait while a child is being started, so a
  handler that stops the children finds every child started (the child unblocks them before
  exec: a signal mask survives exec).
- **Stopping.** `stop()` is SIGTERM to every group, a grace period (the workers drain), then
  SIGKILL to the groups still alive; idempotent, and it also runs at exit. A supervisor that
  runs its own loop (the proxy's) uses the parts: `signal_all`, `kill_running`.
- **Ready.** `wait_ready(url)` polls until the URL answers 200, giving up when the caller's
  `check` raises (a child exited) or the time is up: the one wait-until-ready loop.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# loaded here, not in the child between fork and exec: a thread of this process (a test's
# server, a client) may hold the loader's lock at the fork
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent (the thread that started it)
    ends, SIGKILL included; exit now if `parent_pid` is already gone. A no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_setup() -> Callable[[], None]:
    """The pre-exec hook of every child: dies with this process, stop signals unblocked."""
    parent = os.getpid()

    def hook() -> None:
        die_with_parent(parent)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    return hook


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Stop signals wait (are blocked) inside; one that came is handled on leaving."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@dataclass
class Child:
    """One started process: its name in banners and logs, its URL (if it serves one) and its
    log file (None: it writes where the supervisor does)."""

    name: str
    url: str
    log_path: Path | None
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

    def send(self, sig: int) -> None:
        """`sig` to the child's whole group (it leads its own)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def log_tail(self, num_lines: int = 40) -> str:
        if self.log_path is None:
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def spawn(
    name: str,
    cmd: list[str],
    *,
    url: str = "",
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
    cwd: Path | None = None,
) -> Child:
    """Start `cmd` as a child of this process (its own session, SIGTERM when this process
    dies), its output appended to `log_path` (else this process's), with `env` (else this
    process's environment)."""
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "ab")) if log_path else None  # noqa: SIM115
        stack.enter_context(stop_signals_held())
        popen = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=_child_setup(),  # NOTE: runs between fork and exec: no imports, no locks
        )
    return Child(name, url, log_path, popen)


def wait_ready(
    url: str, timeout_s: float, check: Callable[[], None] = lambda: None, interval_s: float = 0.1
) -> None:
    """Until GET `url` answers 200. `check` runs before each try and raises to give up (a child
    has exited); TimeoutError once `timeout_s` seconds have passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        if _answers_ok(url):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} not ready in {timeout_s:.0f} s")
        time.sleep(interval_s)


def _answers_ok(url: str) -> bool:
    import httpx  # NOTE: here, not above: a tensor-parallel rank imports this module to start

    try:
        return httpx.get(url, timeout=2, verify=tls_context()).status_code == 200
    except httpx.HTTPError:
        return False


@functools.cache
def tls_context():
    """One TLS context for every poll: httpx builds one a call otherwise, parsing certifi's
    bundle again (~20 ms of CPU, against ~1 ms for the request itself on loopback)."""
    import httpx

    return httpx.create_ssl_context()


class Supervisor:
    """Starts children, reports the first one that exits, and stops them all."""

    def __init__(self, env: dict[str, str] | None = None, stop_grace_s: float = 40.0):
        self.env = dict(os.environ) if env is None else env
        self.stop_grace_s = stop_grace_s
        self.children: list[Child] = []
        self._is_forced = False
        atexit.register(self.stop)

    def start(
        self,
        name: str,
        cmd: list[str],
        *,
        url: str = "",
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        cwd: Path | None = None,
    ) -> Child:
        """Start `cmd` (its output to `log_path`, else this process's); `env` replaces the
        supervisor's for this child."""
        with stop_signals_held():  # a stop signal finds the child listed
            child = spawn(
                name,
                cmd,
                url=url,
                log_path=log_path,
                env=self.env if env is None else env,
                pass_fds=pass_fds,
                cwd=cwd,
            )
            self.children.append(child)
        return child

    def running(self) -> list[Child]:
        return [c for c in self.children if c.is_running]

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if not c.is_running), None)

    def signal_all(self, sig: int) -> None:
        for child in self.running():
            child.send(sig)

    def kill_running(self) -> list[Child]:
        """SIGKILL every child still running, and reap it; returns those killed."""
        killed = self.running()
        for child in killed:
            child.send(signal.SIGKILL)
            child.popen.wait()
        return killed

    def stop(self) -> None:
        """SIGTERM every child's group, wait up to the grace period, SIGKILL what is left.

        A second Ctrl-C (or SIGTERM) while waiting skips the rest of the grace period.
        """
        if not self.running():
            return
        handlers = {sig: signal.signal(sig, self._force) for sig in STOP_SIGNALS}
        try:
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            while self.running() and not self._is_forced and time.monotonic() < deadline:
                time.sleep(0.1)
            for child in self.kill_running():
                print(f"{child.name} did not stop in time: SIGKILL", file=sys.stderr)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _force(self, signum: int, frame: object) -> None:
        self._is_forced = True
