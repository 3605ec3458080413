"""Child processes that are started together, watched, and stopped together, and never outlive
the process that started them.

The one supervisor of the tree: deploy/local.py's cluster, the proxy's `--workers N`
(proxy/processes.py) and the benchmarks start their children through it. It lives here, under
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
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
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


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent (the thread that started it)
    ends, SIGKILL included; exit now if `parent_pid` is already gone. A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
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
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(log_path, "ab")) if log_path else None  # noqa: SIM115
            stack.enter_context(stop_signals_held())  # a stop signal finds the child listed
            popen = subprocess.Popen(
                cmd,
                env=self.env if env is None else env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                pass_fds=pass_fds,
                start_new_session=True,
                preexec_fn=_child_setup(),  # safe: no supervisor starts threads before it
            )
            child = Child(name, url, log_path, popen)
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
