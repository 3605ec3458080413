"""Faults on real processes, as one-line steps of a script: freeze (SIGSTOP) and thaw (SIGCONT),
kill -9, restart on the same port with the same arguments (a worker comes back with a new engine
id, as a crashed and rescheduled one would)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from tests.servers import ServerProcess


def freeze(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGSTOP)


def thaw(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)


@contextmanager
def frozen(server: ServerProcess) -> Iterator[ServerProcess]:
    """The process is stopped inside the block and continues after it (also on failure)."""
    freeze(server)
    try:
        yield server
    finally:
        thaw(server)


def kill(server: ServerProcess) -> None:
    """kill -9, and reap it."""
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def is_alive(server: ServerProcess) -> bool:
    return server.proc.poll() is None


def restart(server: ServerProcess) -> ServerProcess:
    """A new process on the same port and arguments (the old one is killed if still alive),
    ready to serve."""
    server.restart(signal.SIGKILL)
    return server.wait_ready(path="/ready" if server.role == "proxy" else "/health")
