"""tests/forkserver.py, the tests' way to start workers: a forked child is `python -m MODULE ARGS`
as a started one would be (its arguments, environment, working directory, log, own session, exit
status, dying with its parent), and what it costs is counted. Its child here is this module run
as `python -m tests.test_forkserver` (the probe at the bottom)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.forkserver import ForkServer, reaped_cpu_seconds
from tests.servers import fork_server, wait_until


@pytest.fixture
def server():
    """The one the tests' servers start from (tests/servers.py)."""
    return fork_server()


@pytest.fixture
def own_server(tmp_path):
    fs = ForkServer(tmp_path / "forkserver.log")
    yield fs
    fs.child.send(signal.SIGKILL)


def probe(server: ForkServer, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    log = tmp_path / "probe.log"
    log.touch()
    cmd = [sys.executable, "-m", "tests.test_forkserver", *args]
    return server.start(cmd, {**os.environ, **(env or {})}, tmp_path, log), log


def test_a_child_runs_its_module_as_started_and_its_exit_status_is_reported(server, tmp_path):
    before = reaped_cpu_seconds()
    child, log = probe(server, tmp_path, "exit", "3", env={"PROBE": "here"})
    assert child.wait(30) == 3
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["argv"] == ["exit", "3"]
    assert seen["env"] == "here"
    assert seen["cwd"] == str(tmp_path)
    assert seen["sid"] == child.pid, "it leads its own session"
    assert seen["ppid"] == server.child.pid, "a child of the fork server"
    assert seen["stdin"] == "", "stdin is /dev/null"
    assert seen["atexit"] is True, "it exits through the interpreter (atexit runs)"
    assert reaped_cpu_seconds() > before


def test_a_signal_is_its_exit_status_and_a_signal_after_exit_is_no_op(server, tmp_path):
    child, log = probe(server, tmp_path, "sleep")
    assert wait_until(lambda: "sleeping" in log.read_text(), 30)
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # reaped: its pid is not ours to signal any more
    assert child.poll() == -signal.SIGKILL


def test_a_child_dies_with_the_fork_server(own_server, tmp_path):
    child, log = probe(own_server, tmp_path, "sleep")
    assert wait_until(lambda: "sleeping" in log.read_text(), 30)
    own_server.child.send(signal.SIGKILL)
    assert wait_until(lambda: not Path(f"/proc/{child.pid}").exists(), 30)
    assert child.wait(30) == -signal.SIGKILL, "the exit of a child of a dead server is a kill"


def _probe() -> None:
    import atexit

    ran = {"atexit": False}
    args = sys.argv[1:]

    def report() -> None:
        ran["atexit"] = True
        print(
            json.dumps(
                {
                    "argv": args,
                    "env": os.environ.get("PROBE"),
                    "cwd": os.getcwd(),
                    "sid": os.getsid(0),
                    "ppid": os.getppid(),
                    "stdin": sys.stdin.read(),
                    "atexit": ran["atexit"],
                }
            ),
            flush=True,
        )

    atexit.register(report)
    if args[0] == "sleep":
        print("sleeping", flush=True)
        time.sleep(600)
    sys.exit(int(args[1]))


if __name__ == "__main__":
    _probe()
