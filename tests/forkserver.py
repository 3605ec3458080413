"""A fork server for the tests' worker and proxy processes: a worker's start costs less than half.

`python -m prefill_server ...` spends ~4 s of CPU importing torch, FastAPI and the server before
it reads its arguments, and the suite starts a few hundred such processes. This module's server
process (one per pytest process, started at the first use) imports all that once and then forks
a child per start; the child runs `python -m MODULE ARGS` from there (`runpy`), so it is the
same program with the same arguments, environment, working directory and log file, leading its
own session and dying with the server (which dies with the pytest process that started it:
common/processes.py's `spawn`). It exits through the interpreter as any process does (threads
joined, `atexit` run), and its exit status reaches the test as `Popen.returncode` would (a
negative signal number for a signal).

Nothing the server imports starts a Python thread, reads the command line or the environment at
import (common/settings.py is read at call time) or loads NIXL: the child does all that itself.
`Forked` is the part of `subprocess.Popen` the tests use: `pid`, `poll`, `wait`, `returncode`,
`send_signal`, `terminate`, `kill`; `reaped_cpu_seconds` is the CPU its children spent
(tests/cpu_report.py adds it to the test process's children).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from common import processes
from deploy.processes import ROOT, child_env

# what `python -m prefill_server|decode_server|proxy` imports before it reads its arguments
PRELOAD = ("common.api.server", "proxy.server")


_reaped_cpu_s = [0.0]


def reaped_cpu_seconds() -> float:
    """The CPU seconds of every fork server child of this process that has exited (and of what
    it started and reaped): what `RUSAGE_CHILDREN` would count had this process started them."""
    return _reaped_cpu_s[0]


class Forked:
    """A child of the fork server, as the tests use a `subprocess.Popen`. Its exit status is set
    by the server's report about this child: a later child may get the same pid."""

    def __init__(self, server: ForkServer, pid: int):
        self._server = server
        self.pid = pid
        self.args: list[str] = []
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self._server.changed:
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._server.changed:  # not once reported: its pid may be another process's now
            if self.returncode is None:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: starts the server process, asks it for children, learns their exits."""

    def __init__(self, log_path: Path):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())]
        fds = (theirs.fileno(),)
        self.child = processes.spawn(
            "forkserver", cmd, log_path=log_path, env=child_env(), pass_fds=fds, cwd=ROOT
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one start at a time
        self.changed = threading.Condition()  # a child started or exited, or the server did
        self._started: list[Forked] = []
        self._running: dict[int, Forked] = {}
        self._closed = False
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    def start(self, cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> Forked:
        """`cmd` (`python -m MODULE ARGS`) as a child of the server; its output to `log_path`."""
        python, flag, *argv = cmd
        if flag != "-m":
            raise ValueError(f"the fork server runs `python -m MODULE ...` only, not {cmd}")
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log_path)}
        with self._lock, self.changed:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            if not self.changed.wait_for(lambda: self._started or self._closed, timeout=30):
                raise RuntimeError("the fork server did not answer in 30 s")
            if not self._started:
                raise RuntimeError(f"the fork server exited:\n{self.child.log_tail()}")
            child = self._started.pop()
            child.args = cmd
            return child

    @property
    def is_running(self) -> bool:
        return not self._closed and self.child.is_running

    def _read(self) -> None:
        for line in self._sock.makefile("rb"):
            message = json.loads(line)
            with self.changed:
                if "exit" in message:
                    child = self._running.pop(message["exit"], None)
                    if child is not None:
                        child.returncode = message["code"]
                    _reaped_cpu_s[0] += message["cpu_s"]
                else:
                    child = self._running[message["pid"]] = Forked(self, message["pid"])
                    self._started.append(child)
                self.changed.notify_all()
        with self.changed:
            self._closed = True
            for child in self._running.values():  # they died with the server
                child.returncode = -signal.SIGKILL
            self.changed.notify_all()


def serve(sock: socket.socket) -> dict:
    """The server's loop: forks a child per request and reports each child's exit. Returns only
    in a child, with its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd's byte is the news
    pending = b""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(sock)
        if sock in ready:
            data = sock.recv(1 << 20)
            if not data:  # the tests are done
                sys.exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sock.close()
                    return request
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        message = {"exit": pid, "code": code, "cpu_s": usage.ru_utime + usage.ru_stime}
        sock.sendall(json.dumps(message).encode() + b"\n")


def become(request: dict) -> None:
    """In the forked child: become `python -m MODULE ARGS` as `subprocess.Popen` would start it
    (own session, stdin from /dev/null, output to the log, the request's environment and
    working directory), dying with the server."""
    server = os.getppid()
    os.setsid()
    processes.die_with_parent(server)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    module, *args = request["argv"]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    become(serve(sock))


if __name__ == "__main__":
    main()
