"""The docker-compose generator and the checked-in compose files.

Every file is validated by `docker-compose config` (Debian's docker-compose; it needs no Docker
engine, deploy/setup.sh installs it), and the invariants are checked on what compose itself
reads back: one GPU per worker and none twice, unique ports, a /health check on every service,
the proxy waiting for every worker and listing every worker's URL.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.cpu import parse_cpu_list
from deploy import compose

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token"
CHECKED_IN = {
    "docker-compose.yml": "--prefill 1 --decode 1 --gpus 2 --host-cores 16",
    "docker-compose.cpu.yml": "--prefill 1 --decode 1 --cpu --host-cores 8",
}
SHAPES = {
    "gpu-1p1d": "--prefill 1 --decode 1 --gpus 2",
    "gpu-2p6d": "--prefill 2 --decode 6 --gpus 8",
    "gpu-1p2d-spare-gpus": "--prefill 1 --decode 2 --gpus 4",
    "cpu-1p1d": "--prefill 1 --decode 1 --cpu",
    "cpu-2p3d-push": "--prefill 2 --decode 3 --cpu --mode push --port 9000",
    "colocated-model-dir": "--prefill 0 --decode 2 --mode colocated --model-dir /srv/models/llama "
    "--kv-cache-memory 40GiB",
    "cpu-1p1d-2-cores": "--prefill 1 --decode 1 --cpu --host-cores 2",
    "cpu-2p3d-2-cores-shared": "--prefill 2 --decode 3 --cpu --host-cores 2",
    "gpu-1p1d-unpinned": "--prefill 1 --decode 1 --gpus 2 --host-cores 0",
}


def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        message = "docker-compose is missing: run deploy/setup.sh (apt-get install docker-compose)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return path


def generate(args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compose.main(args.split())
    return out.getvalue()


def run_generator(args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deploy.compose", *args.split()]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def compose_config(path: Path, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    if token is not None:
        env["PDSERVE_INTERNAL_TOKEN"] = token
    cmd = [docker_compose(), "-f", str(path), "config"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def published_port(entry) -> str:
    if isinstance(entry, dict):
        return str(entry["published"])
    return str(entry).rsplit(":", 1)[0].rsplit(":", 1)[-1]  # "[IP:]HOST:CONTAINER"


def check_invariants(config: dict, shape: str) -> None:
    args = compose.build_parser().parse_args(shape.split())
    services = config["services"]
    workers = {name: s for name, s in services.items() if name != "proxy"}
    assert sorted(workers) == sorted(
        [f"prefill-{i}" for i in range(args.prefill)] + [f"decode-{i}" for i in range(args.decode)]
    )

    gpu_ids = []
    for name, service in workers.items():
        command = service["command"]
        assert command[:3] == ["python", "-m", f"{name.split('-')[0]}_server"], command
        assert flag(command, "--kv-host") == name  # peers reach it by its service name
        assert "ports" not in service, f"{name}: workers stay on the private network"
        assert service["environment"]["PDSERVE_INTERNAL_TOKEN"] == TOKEN
        if args.cpu:
            assert "deploy" not in service and flag(command, "--device") == "cpu"
            continue
        assert flag(command, "--device") == "cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert len(device["device_ids"]) == 1, f"{name}: exactly one GPU per worker"
        gpu_ids += device["device_ids"]
    assert len(gpu_ids) == len(set(gpu_ids)), f"a GPU is assigned twice: {gpu_ids}"
    assert all(0 <= int(g) < (args.gpus or len(workers)) for g in gpu_ids), gpu_ids
    check_cpusets(workers, args.host_cores)

    ports = {name: int(flag(s["command"], "--port")) for name, s in services.items()}
    assert len(set(ports.values())) == len(ports), f"ports collide: {ports}"
    published = [published_port(p) for s in services.values() for p in s.get("ports", [])]
    assert published == [str(args.port)], "only the proxy's port is published"
    for name, service in services.items():
        test = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{ports[name]}/health" in test, f"{name}: {test}"
        assert service["environment"]["PDSERVE_INTERNAL_TOKEN"] == TOKEN

    proxy = services["proxy"]
    assert proxy["depends_on"] == {name: {"condition": "service_healthy"} for name in workers}
    command = proxy["command"]
    listed = {(a, b) for a, b in zip(command, command[1:]) if a in ("--prefill", "--decode")}
    expected = {(f"--{n.split('-')[0]}", f"http://{n}:{ports[n]}") for n in workers}
    assert listed == expected


def check_cpusets(workers: dict, host_cores: int) -> None:
    """Each worker's cpuset is on the host, its torch threads match it, P and D stay apart."""
    if host_cores == 0:
        assert all(
            "cpuset" not in s and "--cpu-threads" not in s["command"] for s in workers.values()
        )
        return
    cores = {}
    for name, service in workers.items():
        cores[name] = parse_cpu_list(service["cpuset"])
        assert cores[name] <= set(range(host_cores)), (name, service["cpuset"])
        assert flag(service["command"], "--cpu-threads") == str(len(cores[name]))
    by_role = {
        role: set().union(*(c for n, c in cores.items() if n.startswith(role)))
        for role in ("prefill", "decode")
    }
    if host_cores >= 2:
        assert not by_role["prefill"] & by_role["decode"], cores
    if len(workers) <= host_cores:
        every = [c for c in cores.values() for c in c]
        assert len(every) == len(set(every)), f"two workers share a core: {cores}"


@pytest.mark.parametrize("filename", sorted(CHECKED_IN))
def test_checked_in_file_is_the_generators_output(filename):
    text = (ROOT / "deploy" / filename).read_text()
    assert text == generate(CHECKED_IN[filename]), f"regenerate deploy/{filename}"
    assert text.startswith(f"# Generated by: python -m deploy.compose {CHECKED_IN[filename]}\n")


@pytest.mark.parametrize("filename", sorted(CHECKED_IN))
def test_checked_in_file_validates(filename):
    result = compose_config(ROOT / "deploy" / filename)
    assert result.returncode == 0, result.stderr
    check_invariants(yaml.safe_load(result.stdout), CHECKED_IN[filename])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_generated_file_validates(shape, tmp_path):
    path = tmp_path / "compose.yml"
    path.write_text(generate(SHAPES[shape]))
    result = compose_config(path)
    assert result.returncode == 0, result.stderr
    check_invariants(yaml.safe_load(result.stdout), SHAPES[shape])


def test_compose_refuses_to_start_without_the_internal_token():
    result = compose_config(ROOT / "deploy" / "docker-compose.yml", token=None)
    assert result.returncode != 0
    assert "PDSERVE_INTERNAL_TOKEN" in result.stdout + result.stderr


def test_more_workers_than_host_cores_warns():
    result = run_generator(SHAPES["cpu-2p3d-2-cores-shared"])
    assert result.returncode == 0, result.stderr
    assert "warning: 5 workers on 2 cores: some workers share a core" in result.stderr


def test_command_line_matches_the_module():
    result = run_generator(SHAPES["gpu-2p6d"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == generate(SHAPES["gpu-2p6d"])


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--prefill 2 --decode 7 --gpus 8", "9 GPUs (one each), but --gpus is 8"),
        ("--prefill 1 --decode 1 --gpus 1", "2 GPUs (one each), but --gpus is 1"),
        ("--gpus-per-worker 2", "tensor parallelism is not supported"),
        ("--cpu --gpus 2", "--gpus and --cpu exclude each other"),
        ("--prefill 0", "--prefill 0 only works with --mode colocated"),
        ("--decode 0", "at least one decode worker"),
        ("--host-cores -1", "--host-cores must be >= 0 (0: no pinning), got -1"),
    ],
)
def test_bad_shape_exits_2_with_a_clear_message(argv, message):
    result = run_generator(argv)
    assert result.returncode == 2
    assert result.stdout == ""
    assert re.search(re.escape(message), result.stderr), result.stderr
