"""The docker-compose generator and the checked-in compose files.

Every file is validated by `docker-compose config` (Debian's docker-compose; it needs no Docker
engine, deploy/setup.sh installs it), and the invariants are checked on what compose itself
reads back: unique ports, a /health check on every service, the proxy waiting for every worker
service and listing it; on GPU one service per worker, a GPU of its own (none twice) among all
the workers' GPUs, which each container sees for CUDA IPC, in the host's IPC and PID namespaces
(a TP-N worker: N GPUs of its own and `--tensor-parallel-size N`, only in colocated mode); on
CPU one service per role that `--scale` can grow (no container name, host port or cpuset,
`--kv-host auto`), found by the proxy as `dns://SERVICE:PORT`. The `monitoring` profile: a
Prometheus whose scrape config (promtool-checked) has a job per pool over every service (by name
on GPU, by every address of the name on CPU), a Grafana provisioned from files that exist with the
generated dashboard, both on 127.0.0.1 only. Nothing is started: no Docker engine here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import zmq

from common.api.cli import parse_args
from common.config import CurveServerKeys
from common.cpu import parse_cpu_list
from common.kv_cache import curve_keys
from common.kv_cache.event_publisher import KVEventPublisher
from deploy import compose
from deploy.cluster import kv_events_keys

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
    "gpu-colocated-tp2": "--prefill 0 --decode 2 --decode-tp 2 --mode colocated --gpus 4",
    "gpu-colocated-mixed-tp": "--prefill 1 --decode 2 --prefill-tp 3 --decode-tp 2 "
    "--mode colocated --gpus 8 --host-cores 16",
    "gpu-colocated-gpus-per-worker": "--prefill 0 --decode 1 --gpus-per-worker 4 --mode colocated",
    "cpu-colocated-tp2": "--prefill 0 --decode 2 --decode-tp 2 --cpu --mode colocated",
    "cpu-pull-mixed-tp": "--prefill 1 --decode 1 --prefill-tp 2 --cpu",  # KV between TP sizes
}


def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        message = "docker-compose is missing: run deploy/setup.sh (apt-get install docker-compose)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return path


@pytest.fixture
def worker_keys(monkeypatch) -> None:
    """KV events keys in the environment, as the secrets give them to a compose worker (which
    refuses to start without them: --kv-events-require-curve)."""
    for variable, value in kv_events_keys().items():
        monkeypatch.setenv(variable, value)


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


def tp_of(args, role: str) -> int:
    """The role's tensor-parallel size as the generator reads its flags."""
    return getattr(args, f"{role}_tp") or args.gpus_per_worker or 1


def check_tensor_parallel(command: list[str], args, role: str) -> None:
    """A TP-N worker gets --tensor-parallel-size N (none at 1); N > 1 on GPUs only colocated."""
    tp = tp_of(args, role)
    assert command.count("--tensor-parallel-size") == (tp > 1), command
    if tp > 1:
        assert flag(command, "--tensor-parallel-size") == str(tp)
        assert args.mode == "colocated" or args.cpu, "P/D KV transfer on GPUs needs TP 1"


def pdserve_services(config: dict) -> dict:
    """The services `docker compose up` starts: every one outside the monitoring profile."""
    return {n: s for n, s in config["services"].items() if not s.get("profiles")}


def check_invariants(config: dict, shape: str) -> None:
    args = compose.build_parser().parse_args(shape.split())
    services = pdserve_services(config)
    workers = {name: s for name, s in services.items() if name != "proxy"}
    (check_scalable_workers if args.cpu else check_gpu_workers)(workers, args)
    for name, service in workers.items():
        assert "ports" not in service, f"{name}: workers stay on the private network"
        assert service["environment"]["PDSERVE_INTERNAL_TOKEN"] == TOKEN

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
    scheme = "dns" if args.cpu else "http"  # dns: every replica of the service, found by name
    expected = {(f"--{n.split('-')[0]}", f"{scheme}://{n}:{ports[n]}") for n in workers}
    assert listed == expected
    if args.cpu:  # a replica added by --scale is routed to within seconds
        assert 0 < float(flag(command, "--discovery-interval")) <= 5
    check_monitoring(config, services)


def check_monitoring(config: dict, services: dict) -> None:
    """Prometheus scrapes every pdserve service, a job per pool; Grafana has the dashboard."""
    monitoring = {n: s for n, s in config["services"].items() if s.get("profiles")}
    assert sorted(monitoring) == ["grafana", "prometheus"], sorted(monitoring)
    assert all(s["profiles"] == ["monitoring"] for s in monitoring.values())
    for name, service in monitoring.items():  # no credentials to guard them: this host only
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), name
    prometheus = yaml.safe_load(
        monitoring["prometheus"]["environment"]["PDSERVE_PROMETHEUS_CONFIG"]
    )
    scraped = set()
    for job in prometheus["scrape_configs"]:
        pool = job["job_name"].removeprefix("pdserve-")
        names = [t for c in job.get("static_configs", []) for t in c["targets"]]
        names += [f"{n}:{c['port']}" for c in job.get("dns_sd_configs", []) for n in c["names"]]
        scraped |= {(pool, t) for t in names}
    expected = {
        (name.split("-")[0], f"{name}:{flag(s['command'], '--port')}")
        for name, s in services.items()
    }
    assert scraped == expected, (scraped, expected)
    mounts = dict(str(v).split(":")[:2] for v in monitoring["grafana"]["volumes"])
    provider = ROOT / "deploy/observability/grafana/provisioning/dashboards/pdserve.yml"
    (dashboards,) = yaml.safe_load(provider.read_text())["providers"]
    dashboard = [t for t in mounts.values() if t.endswith(".json")]
    assert dashboard == [f"{dashboards['options']['path']}/pdserve.json"], mounts


def check_gpu_workers(workers: dict, args) -> None:
    """One service per worker, advertising its name, on GPUs of its own (CUDA_VISIBLE_DEVICES,
    in PCI bus order: one per tensor-parallel rank), none twice; every worker sees every worker's
    GPU and shares the host's IPC and PID namespaces, which UCX's cuda_ipc needs to open a
    peer's CUDA IPC handle."""
    assert sorted(workers) == sorted(
        [f"prefill-{i}" for i in range(args.prefill)] + [f"decode-{i}" for i in range(args.decode)]
    )
    num_gpus = sum(tp_of(args, name.split("-")[0]) for name in workers)
    own_gpus, every_gpu = [], [str(i) for i in range(num_gpus)]
    for name, service in workers.items():
        command, role = service["command"], name.split("-")[0]
        assert command[:3] == ["python", "-m", f"{role}_server"], command
        check_tensor_parallel(command, args, role)
        assert flag(command, "--kv-host") == name  # peers reach it by its service name
        assert flag(command, "--device") == "cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert device["device_ids"] == every_gpu, f"{name}: sees every worker's GPU"
        env = service["environment"]
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # as nvidia-smi and device_ids count
        own = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(own) == tp_of(args, role), f"{name}: one GPU per rank, {own}"
        own_gpus += own
        assert service["ipc"] == "host" and service["pid"] == "host", name
        assert "SYS_PTRACE" in service["cap_add"], name
        assert env["UCX_TLS"].startswith("cuda_ipc,"), name
    assert sorted(own_gpus, key=int) == every_gpu, f"a GPU is run on twice: {own_gpus}"
    assert len(every_gpu) <= (args.gpus or num_gpus)
    check_cpusets(workers, args)


# NOTE: each of these is one value for every replica of a service, so two replicas would collide
# (a container name, a host port) or share what was meant for one (a cpuset, a GPU).
BLOCKS_SCALE = {"container_name", "hostname", "ports", "cpuset", "deploy", "mac_address"}


def check_scalable_workers(workers: dict, args) -> None:
    """One service per role, `scale` replicas of it, nothing that stops `--scale`: each replica
    advertises its own address and the cores it gets are a quota, not a pinned set."""
    counts = {"prefill": args.prefill, "decode": args.decode}
    assert sorted(workers) == sorted(role for role, n in counts.items() if n)
    cores = 0
    for role, service in workers.items():
        command = service["command"]
        assert command[:3] == ["python", "-m", f"{role}_server"], command
        assert flag(command, "--kv-host") == "auto", f"{role}: replicas advertise their own IP"
        assert flag(command, "--host") == "0.0.0.0" and flag(command, "--device") == "cpu"
        assert not BLOCKS_SCALE & service.keys(), f"{role}: {BLOCKS_SCALE & service.keys()}"
        assert service.get("scale", 1) == counts[role]
        check_tensor_parallel(command, args, role)
        if args.host_cores == 0:
            assert "cpus" not in service and "--cpu-threads" not in command
            continue
        assert float(service["cpus"]) == int(flag(command, "--cpu-threads")) >= 1
        cores += float(service["cpus"]) * counts[role]
    if sum(n * tp_of(args, role) for role, n in counts.items()) <= args.host_cores:
        assert cores <= args.host_cores, "the generated scale fits the host's cores"


def check_cpusets(workers: dict, args) -> None:
    """Each worker's cpuset is on the host, its torch threads match it, P and D stay apart, a
    TP-N worker has a core per rank where the host has enough."""
    host_cores = args.host_cores
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
        num_ranks = sum(tp_of(args, n.split("-")[0]) for n in workers)
        if num_ranks <= host_cores:
            assert len(cores[name]) >= tp_of(args, name.split("-")[0]), (name, cores[name])
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
def test_the_monitoring_profile_uses_the_files_in_the_tree(filename, tmp_path):
    """Grafana's mounts are this tree's provisioning files and generated dashboard, and the
    Prometheus config is one Prometheus's own checker accepts."""
    result = compose_config(ROOT / "deploy" / filename)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    mounts = dict(str(v).split(":")[:2] for v in services["grafana"]["volumes"])
    observability = ROOT / "deploy" / "observability" / "grafana"
    assert mounts[str(observability / "provisioning")] == "/etc/grafana/provisioning"
    assert str(observability / "pdserve.json") in mounts
    (datasource,) = yaml.safe_load(
        (observability / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["isDefault"]
    promtool = shutil.which("promtool")
    if promtool is None:  # Debian's prometheus package has it; deploy/setup.sh installs that
        pytest.fail("promtool is missing: apt-get install prometheus (deploy/setup.sh does)")
    config = tmp_path / "prometheus.yml"
    config.write_text(services["prometheus"]["environment"]["PDSERVE_PROMETHEUS_CONFIG"])
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


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


@pytest.mark.parametrize("address", ["172.18.0.5", "172.18.0.6"])
def test_cpu_replicas_advertise_their_own_address(address, monkeypatch, worker_keys):
    """Each replica runs the same command; `--kv-host auto` makes it advertise its own IP."""
    in_a_container(monkeypatch, address)
    services = yaml.safe_load((ROOT / "deploy" / "docker-compose.cpu.yml").read_text())["services"]
    for role in ("prefill", "decode"):
        engine, server = parse_args(role, services[role]["command"][3:])
        assert engine.transfer.advertise_host == address and server.host == "0.0.0.0"
        assert server.cpu.num_threads == services[role]["cpus"]


@pytest.mark.parametrize("key, value", [("container_name", "decode"), ("cpuset", "4-7")])
def test_a_key_that_blocks_scaling_is_caught(key, value):
    config = compose.build_compose(compose.Shape(is_cpu=True, host_cores=8))
    config["services"]["decode"][key] = value
    with pytest.raises(AssertionError, match=key):
        check_invariants(config, CHECKED_IN["docker-compose.cpu.yml"])


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
        (
            "--decode-tp 2",
            "--decode-tp 2 with --mode pull on GPUs: P/D KV transfer between CUDA workers needs "
            "tensor parallelism 1 for now",
        ),
        ("--prefill-tp 2 --mode push", "--prefill-tp 2 with --mode push on GPUs: P/D KV"),
        ("--gpus-per-worker 2", "--prefill-tp 2 and --decode-tp 2 with --mode pull on GPUs"),
        ("--gpus-per-worker 2 --decode-tp 2", "--gpus-per-worker N is short for --prefill-tp N"),
        ("--prefill 0 --decode-tp 0 --mode colocated", "--decode-tp must be >= 1, got 0"),
        (
            "--prefill 0 --decode 2 --decode-tp 2 --mode colocated --gpus 3",
            "2 decode workers need 4 GPUs (2 per decode worker), but --gpus is 3",
        ),
        (
            "--prefill 1 --decode 1 --decode-tp 4 --mode colocated --gpus 4",
            "need 5 GPUs (1 per prefill worker, 4 per decode worker), but --gpus is 4",
        ),
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


def test_a_tp_worker_gets_its_own_gpus_and_a_command_the_worker_accepts(worker_keys):
    """Colocated decode workers of TP 2 on 4 GPUs: GPUs 0,1 and 2,3, every container seeing all
    four, and a command the worker's own parser takes (no KV connector: it would refuse nixl)."""
    text = generate(SHAPES["gpu-colocated-tp2"])
    services = yaml.safe_load(text)["services"]
    assert flag(services["proxy"]["command"], "--mode") == "colocated"
    for name, gpus in (("decode-0", "0,1"), ("decode-1", "2,3")):
        service = services[name]
        assert service["environment"]["CUDA_VISIBLE_DEVICES"] == gpus
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0", "1", "2", "3"]
        engine, _ = parse_args("decode", service["command"][3:])
        assert engine.parallel.tensor_parallel_size == 2
        assert engine.transfer.connector is None
    same = generate("--prefill 0 --decode 2 --gpus-per-worker 2 --mode colocated --gpus 4")
    body = text.split("\n", 1)[1]  # after the header, which names the flags
    assert same.split("\n", 1)[1] == body, "--gpus-per-worker N is --prefill-tp N --decode-tp N"
    header = text.splitlines()[0].removeprefix("# Generated by: python -m deploy.compose ")
    assert "--decode-tp 2" in header and generate(header) == text, "the header reproduces it"


@pytest.mark.parametrize("filename", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_workers_publish_kv_events_bound_to_their_host(filename, worker_keys):
    services = pdserve_services(yaml.safe_load((ROOT / "deploy" / filename).read_text()))
    workers = [s["command"] for s in services.values() if str(s["command"][2]).endswith("_server")]
    assert len(workers) == 2
    for command in workers:
        role = command[2].removesuffix("_server")
        assert flag(command, "--kv-events-endpoint") == "tcp://*:5557"
        engine, _ = parse_args(role, command[command.index("--kv-events-endpoint") :])
        assert engine.kv_events.replay_endpoint == "tcp://*:5558"


@pytest.mark.parametrize("filename", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_each_worker_builds_its_kernels_outside_the_shared_volume(filename):
    services = pdserve_services(yaml.safe_load((ROOT / "deploy" / filename).read_text()))
    workers = [s for s in services.values() if str(s["command"][2]).endswith("_server")]
    assert len(workers) == 2
    for service in workers:
        kernels = Path(service["environment"]["PDSERVE_KERNEL_CACHE_DIR"])
        mounts = [Path(str(v).split(":")[1]) for v in service.get("volumes", [])]
        assert mounts and not any(kernels.is_relative_to(m) for m in mounts), (kernels, mounts)


def in_a_container(monkeypatch, address: str = "172.18.0.5") -> None:
    """`--kv-host auto` as a container resolves it: its id, to its address on the network."""
    monkeypatch.setattr(socket, "gethostname", lambda: "a1b2c3d4e5f6")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: address)


def mounted_keys(service: dict, secrets: dict) -> dict[str, str]:
    """The service's `_FILE` variables, each pointing at the host file compose mounts there (the
    secrets it lists only, at /run/secrets/NAME), as the process in the container reads them."""
    mounted = {
        f"/run/secrets/{s['source']}": secrets[s["source"]]["file"] for s in service["secrets"]
    }
    env = service["environment"]
    return {k: mounted[v] for k, v in env.items() if k.endswith("_FILE") and v in mounted}


@pytest.mark.parametrize("filename", sorted(CHECKED_IN))
def test_kv_events_are_curve_encrypted_with_keys_from_secrets(filename, tmp_path, monkeypatch):
    """The key files of the one-time step, mounted as compose secrets: every worker reads its
    secret key and the proxy's public key (and starts only with them), the proxy the workers'
    public key and its own secret key, and no process sees the other side's secret key."""
    in_a_container(monkeypatch)
    (tmp_path / filename).write_text((ROOT / "deploy" / filename).read_text())
    curve_keys.write_key_pairs(tmp_path / "kv-events")  # what docs/deploy.md has you run
    result = compose_config(tmp_path / filename)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert "secrets" in config, "no KV events keys: the file mounts no secrets"
    services = pdserve_services(config)
    proxy = curve_keys.CurveClientKeys.from_env(mounted_keys(services["proxy"], config["secrets"]))
    assert proxy is not None, "the proxy subscribes without CURVE keys"
    workers = {n: s for n, s in services.items() if n != "proxy"}
    for name, service in workers.items():
        command = service["command"]
        for variable in curve_keys.SERVER_SECRET_KEY, curve_keys.CLIENT_KEYS:
            monkeypatch.delenv(variable, raising=False)
            monkeypatch.delenv(f"{variable}_FILE", raising=False)
        with pytest.raises(SystemExit):  # no keys: the worker refuses to start
            parse_args(command[2].removesuffix("_server"), command[3:])
        for variable, path in mounted_keys(service, config["secrets"]).items():
            monkeypatch.setenv(variable, path)
        engine, _ = parse_args(command[2].removesuffix("_server"), command[3:])
        keys = engine.kv_events.curve
        assert keys is not None, f"{name}: KV events without CURVE"
        assert curve_keys.public_key(keys.secret_key) == proxy.server_key, name
        assert keys.client_public_keys == (proxy.public_key,), name
    secret_files = {
        s: config["secrets"][s]["file"] for s in ("kv_events_server_key", "kv_events_client_key")
    }
    for name, service in services.items():
        mounted = {config["secrets"][s["source"]]["file"] for s in service["secrets"]}
        own = secret_files["kv_events_client_key" if name == "proxy" else "kv_events_server_key"]
        assert mounted & set(secret_files.values()) == {own}, f"{name} holds another's secret"


def test_the_key_files_stay_out_of_git_and_the_image():
    assert "deploy/kv-events" in (ROOT / ".dockerignore").read_text().split()
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", "deploy/kv-events/server.key"], cwd=ROOT, timeout=30
        )
        assert ignored.returncode == 0, "deploy/kv-events/ is not git-ignored"


def test_a_compose_worker_without_keys_warns_at_start(caplog, monkeypatch):
    """The worker's publisher, as compose configures it but with no keys (and without
    --kv-events-require-curve), names every socket it binds in a warning; with keys, none."""
    in_a_container(monkeypatch)
    services = pdserve_services(
        yaml.safe_load((ROOT / "deploy" / "docker-compose.cpu.yml").read_text())
    )
    command = [a for a in services["decode"]["command"] if a != "--kv-events-require-curve"]
    engine, _ = parse_args("decode", command[3:])
    assert engine.kv_events.curve is None and engine.kv_events.bind_host == "0.0.0.0"
    # the same wildcards, on loopback and ports the OS picks (this test binds nothing public)
    cfg = dataclasses.replace(
        engine.kv_events, endpoint="tcp://*:*", replay_endpoint="tcp://*:*", bind_host="127.0.0.1"
    )
    secret = zmq.curve_keypair()[1].decode()
    for curve in None, CurveServerKeys(secret, (zmq.curve_keypair()[0].decode(),)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="common.kv_cache.event_publisher"):
            KVEventPublisher(dataclasses.replace(cfg, curve=curve)).close()
        warnings = [r.getMessage() for r in caplog.records if "NOT AUTHENTICATED" in r.getMessage()]
        if curve is None:
            assert warnings and "tcp://127.0.0.1:* and tcp://127.0.0.1:*" in warnings[0], warnings
        else:
            assert not warnings, warnings
