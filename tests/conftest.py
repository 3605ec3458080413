from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deploy.processes import TLS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every NIXL agent of the suite (in-process and in the workers it starts): an idle agent's
# progress thread polls every 10 ms instead of 1 ms, ~0.3% of a core instead of ~1.5%; with a
# dozen workers idle at a time that was ~5% of the 2-core box, and P/D latency did not change
# (docs/deploy.md, "Environment variables")
os.environ.setdefault("PDSERVE_NIXL_PROGRESS_DELAY_US", "10000")
# httpx.get(...) and the like build a client, and with it a TLS context, on each call: ~20 ms of
# CPU parsing certifi's bundle, ~20x the loopback request itself. The tests make thousands of such
# calls (polls every 0.1 s), so here they share one context (a call may still pass its own).
for _name in ("request", "stream", "get", "options", "head", "post", "put", "patch", "delete"):
    setattr(httpx, _name, functools.partial(getattr(httpx, _name), verify=TLS))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one torch thread in each test process and each worker it starts (they honour it, as torch
    # does): with a pytest worker per core, OpenMP's spinning threads of two tests on one core
    # made in-process models several times slower than alone
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name) → folder of a tiny random HF model (built once per session)."""
    from tests.tiny_models import build_tiny_model

    built: dict[str, object] = {}

    def get(name: str = "llama"):
        if name not in built:
            built[name] = build_tiny_model(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(role, *args) → a ready ServerProcess; all are stopped at module end.
    `wait=False`: started, not yet ready (`wait_ready()` it): workers a fixture needs together
    start side by side."""
    from tests.servers import ServerProcess

    started = []

    def start(role: str, *args: str, wait: bool = True):
        log = tmp_path_factory.mktemp("logs") / f"{role}.log"
        server = ServerProcess(role, list(args), log)
        started.append(server)
        if not wait:
            return server
        return server.wait_ready(path="/ready" if role == "proxy" else "/health")

    yield start
    # side by side: a worker's drain (held KV, a lease) must not wait for another's
    with ThreadPoolExecutor(max(1, len(started))) as pool:
        list(pool.map(lambda server: server.stop(), started))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny test tokenizer (byte-level BPE, ChatML template)."""
    from common.tokenizer import Tokenizer
    from tests.tiny_tokenizer import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_dir(folder)


# Modules that take 40 s or more (pytest --durations): pytest-xdist hands out whole modules
# (deploy/test.sh), and one of these started last would run on alone while the other cores idle.
LONG_MODULES = (  # the longest first (seconds of a 3-worker run on 2 cores, 2026-12-06)
    "tests/chaos/test_chaos_long.py",  # 133 (the chaos package runs as one unit: tests/chaos/)
    "tests/test_tensor_parallel.py",  # 117
    "tests/test_deploy_local.py",  # 106
    "tests/test_pd_pull.py",  # 85
    "tests/test_migration.py",  # 80 alone
    "tests/test_pd_tensor_parallel.py",  # 83
    "tests/test_observability.py",  # 33-88 alone, the machine shared (load average 4-12)
    "tests/test_gpu_check.py",  # 59
    "tests/test_kv_peers.py",  # 56
    "tests/test_smollm2.py",  # 49
    "tests/test_proxy_processes.py",  # 48
    "tests/test_default_model.py",  # 42
    "tests/test_no_leak.py",  # 41
    "tests/test_bf16_parity.py",  # 22 here, 35-83 s on a busy machine
)


# Packages whose modules share processes (a package-scoped fixture): pytest-xdist hands out each
# as one unit, so that its workers start once, not once on every pytest worker that drew one of
# its modules (the chaos package's P and D were started on all three).
SHARED_PACKAGES = ("tests/chaos/",)


def unit_of(nodeid: str) -> str:
    """The unit pytest-xdist hands out whole under deploy/test.sh's `--dist loadfile`: a test's
    module, or its package when the package shares its processes."""
    path = nodeid.split("::")[0]
    return next((package for package in SHARED_PACKAGES if path.startswith(package)), path)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown without it (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, by unit_of's units (pytest-xdist's `xdist_group` marks cannot do it
    under pytest 9: they rewrite a test's id, which pytest 9 no longer keeps in `_nodeid`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The long units first, in the order above; the rest keep their order."""
    rank = {unit_of(path): i for i, path in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(unit_of(item.nodeid), len(rank)))
