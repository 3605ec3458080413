"""The one cluster starter: P and D workers and the proxy in front, from a validated config.

deploy/local.py is the command line around it, benchmarks/cluster.py the benchmarks' way to it;
common/processes.py starts and stops the processes, and `cluster_env` is their environment.
Workers bind 127.0.0.1 on their role's usual ports (8100, 8101, ... and 8200, 8201, ...) where
those are free, else on ports the OS hands out; the proxy gets `--port` (0: any free one) and
lists every worker's URL. Workers split the launcher's cores (deploy/cores.py): each gets its
own `--cpu-cores` and `--cpu-threads`, unless `--no-cpu-split`; a worker with
`--tensor-parallel-size N` (`--prefill-tp`/`--decode-tp`, colocated mode only: deploy/tp.py)
gets N workers' share, one run of cores per rank.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq

from common.kv_cache import curve_keys
from common.processes import Child, Supervisor
from deploy.compose import BASE_PORTS, MODES, PROXY_PORT
from deploy.cores import CpuPlan, WorkerCpu, plan_cores
from deploy.processes import ROOT, free_port
from deploy.tp import check_tensor_parallel, is_cuda, tp_args

DEFAULT_MODEL = "SmolLM2-135M-Instruct (built-in)"
WORKER_HOST = "127.0.0.1"
CPU_FLAGS = ("--cpu-cores", "--cpu-threads")
LAUNCHER_FLAGS = (
    "--port",
    "--internal-token",
    "--internal-token-file",  # a token of the user's would override the launcher's (env) one
    "--tensor-parallel-size",
    "-tp",
)


@dataclass(frozen=True)
class LocalConfig:
    """What to run; validates itself."""

    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1  # each worker's --tensor-parallel-size: > 1 only colocated
    decode_tp: int = 1
    model: str | None = None  # an HF-format folder; None: the built-in default model
    host: str = "127.0.0.1"  # the proxy's bind address (workers stay on 127.0.0.1)
    port: int = PROXY_PORT  # 0: any free port
    mode: str = "pull"
    log_dir: str | None = None  # None: a fresh folder under the system's temp dir
    is_waiting: bool = True  # wait for /ready before reporting it (and before --ask)
    question: str | None = None
    is_exit_after_ask: bool = False
    ready_timeout_s: float = 600.0
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()  # after worker_args, to the prefill workers only
    decode_args: tuple[str, ...] = ()  # and to the decode workers only
    proxy_args: tuple[str, ...] = ()
    is_cpu_split: bool = True  # each worker gets its own cores (deploy/cores.py)
    cores: tuple[int, ...] | None = None  # the cores split among the workers; None: all we have
    is_kv_events: bool = True  # workers publish KV events on loopback, the proxy routes by them
    prometheus_port: int | None = None  # a Prometheus scraping every process here (0: any port)

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("need at least one decode worker and no negative counts")
        if self.num_prefill == 0 and self.mode != "colocated":
            raise ValueError(f"--prefill 0 only works with --mode colocated, not {self.mode}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        check_tensor_parallel(self.mode, self.tp, is_cuda(self.worker_args))
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port < 65536:
            raise ValueError(f"--prometheus must be in [0, 65535], got {self.prometheus_port}")
        if self.model is not None and not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model}: no such folder")
        if self.is_exit_after_ask and self.question is None:
            raise ValueError("--exit needs --ask")
        if self.question is not None and not self.is_waiting:
            raise ValueError("--ask needs the cluster ready: drop --no-wait")
        all_args = (*self.worker_args, *self.prefill_args, *self.decode_args)
        if any(names_flag(arg, LAUNCHER_FLAGS) for arg in all_args):
            raise ValueError(
                "the launcher sets the workers' --port, --internal-token and "
                "--tensor-parallel-size (--prefill-tp N, --decode-tp N); the token goes in their "
                "environment, so --internal-token-file is refused too"
            )
        if self.is_cpu_split and any(names_flag(arg, CPU_FLAGS) for arg in all_args):
            raise ValueError(
                "the launcher splits the cores among the workers (--cpu-cores, --cpu-threads); "
                "to give every worker your own, add --no-cpu-split"
            )

    @property
    def tp(self) -> dict[str, int]:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}

    def role_args(self, role: str) -> tuple[str, ...]:
        """Every worker's arguments, then the role's own."""
        return (*self.worker_args, *(self.prefill_args if role == "prefill" else self.decode_args))

    @property
    def model_name(self) -> str:
        return self.model or DEFAULT_MODEL

    @property
    def cpu_plan(self) -> CpuPlan | None:
        """The launcher's cores split among the workers; None with --no-cpu-split."""
        if not self.is_cpu_split:
            return None
        cores = sorted(self.cores or os.sched_getaffinity(0))
        return plan_cores(self.num_prefill, self.num_decode, cores, self.prefill_tp, self.decode_tp)


def names_flag(arg: str, flags: tuple[str, ...]) -> bool:
    """Whether a worker argument sets one of `flags`: itself, `FLAG=VALUE`, or a long option's
    abbreviation, which the worker's parser expands (`--internal-token-f PATH`)."""
    name = arg.partition("=")[0]
    if name in flags:
        return True
    return name.startswith("--") and len(name) > 2 and any(f.startswith(name) for f in flags)


def is_port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def pick_port(host: str, preferred: int | None, taken: set[int]) -> int:
    """`preferred` when it is free, else `free_port`'s pick; never one in `taken`."""
    port = preferred
    while port is None or port in taken or not is_port_free(host, port):
        port = free_port()
    taken.add(port)
    return port


def kv_events_keys() -> dict[str, str]:
    """Fresh CURVE keys for the KV events (common/kv_cache/curve_keys.py): the workers' pair and
    the proxy's, every child reading its own from the shared environment."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {
        curve_keys.SERVER_SECRET_KEY: server_secret.decode(),
        curve_keys.CLIENT_KEYS: client_public.decode(),
        curve_keys.SERVER_KEY: server_public.decode(),
        curve_keys.CLIENT_SECRET_KEY: client_secret.decode(),
    }


def cluster_env() -> dict[str, str]:
    """The children's environment: this one, plus one random internal token (there, not on
    their command lines), the repository on PYTHONPATH, and fresh KV events keys."""
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=secrets.token_hex(32), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(kv_events_keys())
    return env


def worker_command(
    cfg: LocalConfig,
    role: str,
    port: int,
    cpu: WorkerCpu | None,
    events: tuple[int, int] | None = None,
) -> list[str]:
    """The worker's command; `events`: the ports of its KV events PUB and replay ROUTER (bound
    on the worker's host, loopback), unless the worker arguments name their own."""
    cmd = [sys.executable, "-m", f"{role}_server", "--port", str(port)]
    if cfg.model:
        cmd += ["--model", str(Path(cfg.model).resolve())]
    cmd += tp_args(cfg.tp[role])
    own = any(arg.startswith("--kv-events-endpoint") for arg in cfg.role_args(role))
    if events is not None and not own:
        cmd += ["--kv-events-endpoint", f"tcp://*:{events[0]}"]
        cmd += ["--kv-events-replay-endpoint", f"tcp://*:{events[1]}"]
        cmd += ["--kv-events-require-curve"]  # the keys: cluster_env's
    if cpu is not None:
        cmd += cpu.worker_args()
    return cmd + list(cfg.role_args(role))


def proxy_command(cfg: LocalConfig, port: int, urls: dict[str, list[str]]) -> list[str]:
    """The proxy's command; `urls` are the workers' by role."""
    cmd = [sys.executable, "-m", "proxy", "--host", cfg.host, "--port", str(port)]
    cmd += ["--mode", cfg.mode]
    for role, role_urls in urls.items():
        cmd += [arg for url in role_urls for arg in (f"--{role}", url)]
    return cmd + list(cfg.proxy_args)


@dataclass
class Cluster:
    """A started cluster: its workers by role, and the proxy in front of them."""

    proxy: Child
    workers: dict[str, list[Child]]

    @property
    def children(self) -> list[Child]:
        """The proxy first, then every worker."""
        return [self.proxy, *(c for role in self.workers.values() for c in role)]

    def urls(self, role: str) -> list[str]:
        return [c.url for c in self.workers[role]]


def start_cluster(cfg: LocalConfig, sup: Supervisor, proxy_port: int, log_dir: Path) -> Cluster:
    """Start the workers, then the proxy in front of them; nothing is waited for."""
    taken = {proxy_port}
    plan = cfg.cpu_plan
    workers: dict[str, list[Child]] = {"prefill": [], "decode": []}
    for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
        for i in range(count):
            port = pick_port(WORKER_HOST, BASE_PORTS[role] + i, taken)
            name = f"{role}-{i}"
            cpu = plan.workers[name] if plan is not None else None
            events = None
            if cfg.is_kv_events:
                events = (pick_port(WORKER_HOST, None, taken), pick_port(WORKER_HOST, None, taken))
            cmd = worker_command(cfg, role, port, cpu, events)
            url = f"http://{WORKER_HOST}:{port}"
            workers[role].append(sup.start(name, cmd, url=url, log_path=log_dir / f"{name}.log"))
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host  # where clients connect
    urls = {role: [c.url for c in children] for role, children in workers.items()}
    cmd = proxy_command(cfg, proxy_port, urls)
    url = f"http://{host}:{proxy_port}"
    return Cluster(sup.start("proxy", cmd, url=url, log_path=log_dir / "proxy.log"), workers)


def banner(cfg: LocalConfig, children: list[Child]) -> str:
    p, d = (f" (TP {cfg.tp[role]} each)" if cfg.tp[role] > 1 else "" for role in cfg.tp)
    head = (
        f"pdserve local cluster: {cfg.num_prefill} prefill{p} + {cfg.num_decode} decode{d}, "
        f"mode {cfg.mode}, model {cfg.model_name}"
    )
    plan = cfg.cpu_plan
    warnings = [f"warning: {w}" for w in plan.warnings] if plan is not None else []
    rows = [
        f"  {c.name:<10} {c.url:<24} pid {c.pid:<8} {_cpu_column(plan, c.name):<20} "
        f"log {c.log_path}"
        for c in children
    ]
    return "\n".join([head, *warnings, *rows])


def _cpu_column(plan: CpuPlan | None, name: str) -> str:
    if plan is None or name not in plan.workers:
        return "any core"  # the proxy, and every worker with --no-cpu-split
    return plan.workers[name].describe()
