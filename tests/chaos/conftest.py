"""Chaos fixtures: one real P and one real D for the whole package (`workers`), each module
puts a proxy in front (`tests.chaos.cluster`); a test may break any of them, `heal()` puts them
back. `chaos_long` tests (the mid-push faults under load) run with the rest of the suite, in CI
too; `-m "not chaos_long"` leaves them out of a quick local run."""

from __future__ import annotations

import pytest

from tests.chaos.cluster import D_WORKER, P_WORKER, WORKER
from tests.servers import ServerProcess


@pytest.fixture(scope="package")
def start_worker(tiny_model, tmp_path_factory):
    """start_worker(role, *args) → a worker on the tiny model, started, not yet waited for
    (`wait_ready`: start those a fixture needs together), stopped at package end (the
    package's tests share workers: each start costs seconds of two shared cores)."""
    started: list[ServerProcess] = []

    def start(role: str, *args: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("chaos-logs") / f"{role}.log"
        server = ServerProcess(role, ["--model", str(tiny_model("llama")), *WORKER, *args], log)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="package")
def workers(start_worker) -> tuple[ServerProcess, ServerProcess]:
    """P and D, shared by every module: a test that breaks one heals it."""
    p, d = start_worker("prefill", *P_WORKER), start_worker("decode", *D_WORKER)
    return p.wait_ready(), d.wait_ready()
