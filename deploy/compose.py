"""Generate a docker-compose file for one node: prefill and decode workers and the proxy in front.

    python -m deploy.compose --prefill 2 --decode 6 --gpus 8 > compose.yml
    python -m deploy.compose --prefill 1 --decode 1 --cpu > compose.cpu.yml
    python -m deploy.compose --prefill 0 --decode 2 --decode-tp 2 --mode colocated --gpus 4

GPU: one service per worker (prefill-0, ..., decode-0, ...), each running on a GPU of its own
(prefill workers take the first ones), on its own port (prefill 8100, 8101, ...; decode 8200,
8201, ...), advertising its service name as `--kv-host`, the address its NIXL peers use; the
proxy lists every worker's URL. Every worker container sees every worker's GPU (its device
reservation lists them all) and runs on its own through CUDA_VISIBLE_DEVICES, counted in PCI bus
order like nvidia-smi: UCX's cuda_ipc (KV over NVLink) opens the peer's CUDA IPC handle, which
works for a GPU that CUDA_VISIBLE_DEVICES hides but not for one missing from the container,
where UCX falls back to tcp without a word. docs/deploy.md has the sources; each worker's
`pdserve_kv_transport_info` shows what UCX chose.

Tensor parallelism (`--prefill-tp N`, `--decode-tp N`; `--gpus-per-worker N` is short for both):
a TP-N worker runs `--tensor-parallel-size N` on N GPUs of its own, consecutive ones, which its
CUDA_VISIBLE_DEVICES lists (`2,3`; its ranks take cuda:0..N-1 of them); device_ids still lists
every worker's GPUs, and --gpus must cover N per worker. A TP-N GPU worker has no P/D KV
transfer yet, so on GPUs TP > 1 needs `--mode colocated`; other modes exit 2 (deploy/tp.py)
rather than write a file whose workers refuse to start. With `--cpu` any TP sizes go.

CPU: one service per role, `prefill` on 8100 and `decode` on 8200, with `scale: N` for N > 1,
so that `docker-compose up --scale decode=3` adds replicas without a new file: nothing pins a
replica (no container name, no published port, no cpuset), each advertises its own container IP
(`--kv-host auto`), and the proxy's pools are `dns://prefill:8100` and `dns://decode:8200`,
re-resolved every DISCOVERY_INTERVAL seconds through Docker's DNS, which answers a service's name
with every replica's address.

Only the proxy's port is published (and, in the `monitoring` profile, Prometheus's and
Grafana's on 127.0.0.1: deploy/observability/monitoring.py; `--profile monitoring` starts them).
Workers share `PDSERVE_INTERNAL_TOKEN`, which compose takes from the environment or an `.env`
file and refuses to start without.

KV events (prompt token ids) are CURVE-encrypted and only the proxy's key may subscribe: the key
files of `python -m common.kv_cache.curve_keys deploy/kv-events` (a one-time step, docs/deploy.md;
git and the image build ignore the folder) are compose secrets, each process given only its own
(a worker: the workers' secret key and the proxy's public key; the proxy: the workers' public
key and its own secret key) through the `_FILE` twins of common/kv_cache/curve_keys.py. Without
the files compose does not start, and a worker without keys would refuse to
(`--kv-events-require-curve`).

deploy/docker-compose.yml and deploy/docker-compose.cpu.yml are this script's output for their
shapes (the command is in each file's first line); tests/test_deploy_compose.py checks that.
A shape that does not fit (more tensor-parallel ranks than GPUs) exits 2 with a message naming
the numbers.

Cores (`--host-cores N`, default this machine's count; the plan of deploy/cores.py, prefill and
decode apart, one torch thread per core, N runs for a TP-N worker): a GPU worker gets its run of
cores as `cpuset` (the whole container, NIXL/UCX threads included, stays there) and
`--cpu-threads` to match. A CPU replica gets as many cores as a `cpus:` limit (a CPU-time quota,
not pinning: a scaled replica cannot have cores of its own) and `--cpu-threads` to match, the
count the plan gives each worker of its role at the generated scale; scaled beyond it, the
replicas share the host's cores. With more workers (ranks) than cores a warning goes to stderr.
The proxy is light and unpinned.
`--host-cores 0` sets no limit (every worker takes every core).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import yaml  # PyYAML: already installed as a dependency of gguf, which the project requires

from common.kv_cache import curve_keys
from deploy.cores import CpuPlan, plan_cores
from deploy.observability import monitoring
from deploy.tp import add_tp_args, check_tensor_parallel, tp_args

BASE_PORTS = {"prefill": 8100, "decode": 8200}
MAX_WORKERS_PER_ROLE = 100  # prefill ports stay below 8200, decode ports below 8300
PROXY_PORT = 8000
DISCOVERY_INTERVAL = 2  # CPU: seconds until the proxy sees a replica come or go
CACHE_VOLUME, CACHE_DIR = "pdserve-cache", "/cache"  # PDSERVE_CACHE_DIR: the prepared default model
KERNEL_DIR = "/tmp/pdserve-kernels"  # in the container's own filesystem, outside the shared volume
MODEL_MOUNT = "/model"
MODES = ("pull", "push", "colocated")
TOKEN = "${PDSERVE_INTERNAL_TOKEN:?set PDSERVE_INTERNAL_TOKEN, e.g. in deploy/.env}"
# NOTE: UCX's intra-node transports need more than the network: cma (process_vm_readv) only
# reaches peers in the same PID namespace with ptrace rights (pid: host + SYS_PTRACE; Docker's
# default seccomp profile blocks it otherwise); cuda_ipc needs the peer's GPU in the container,
# the host IPC namespace and the peer's PID as this process sees it (pid: host). Without them UCX
# silently falls back to tcp, several times slower. eth0 is the compose network.
UCX_TLS = {"cuda": "cuda_ipc,cuda_copy,cma,tcp", "cpu": "cma,tcp"}


# KV events CURVE keys: compose secret -> the key file under the compose file's folder
KEYS_DIR = "./kv-events"  # python -m common.kv_cache.curve_keys deploy/kv-events
KEY_SECRETS = {
    "kv_events_server_key": "server.key",
    "kv_events_server_pub": "server.pub",
    "kv_events_client_key": "client.key",
    "kv_events_client_pub": "client.pub",
}
# each process's variables (the `_FILE` twins) and the secrets they name, in /run/secrets
WORKER_KEYS = {
    f"{curve_keys.SERVER_SECRET_KEY}_FILE": "kv_events_server_key",
    f"{curve_keys.CLIENT_KEYS}_FILE": "kv_events_client_pub",
}
PROXY_KEYS = {
    f"{curve_keys.SERVER_KEY}_FILE": "kv_events_server_pub",
    f"{curve_keys.CLIENT_SECRET_KEY}_FILE": "kv_events_client_key",
}


class Flow(list):
    """A list that is written on one line: `[python, -m, proxy]`."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # no &id001 anchors for repeated values
        return True


class Block(str):
    """A string of several lines that is written as a `|` block (the monitoring profile's
    Prometheus config), as it reads in a file of its own."""


_Dumper.add_representer(
    Flow, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)
_Dumper.add_representer(
    Block, lambda d, data: d.represent_scalar("tag:yaml.org,2002:str", str(data), style="|")
)


@dataclass(frozen=True)
class Shape:
    """What to deploy on one node; validates itself."""

    num_prefill: int = 1
    num_decode: int = 1
    num_gpus: int | None = None  # None: one per TP rank on GPU; must stay None with is_cpu
    is_cpu: bool = False
    prefill_tp: int = 1  # each prefill worker's --tensor-parallel-size (and GPUs)
    decode_tp: int = 1
    image: str | None = None  # None: pdserve:latest (GPU) or pdserve:cpu
    model_dir: str | None = None  # host folder of an HF model; None: the built-in default model
    kv_cache_memory: str | None = None  # passed to workers as --kv-cache-memory
    mode: str = "pull"
    port: int = PROXY_PORT  # the proxy's published port on the host
    host_cores: int = 0  # cores the workers split (deploy/cores.py); 0: no pinning

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("need at least one decode worker and no negative counts")
        if self.num_prefill == 0 and self.mode != "colocated":
            raise ValueError(f"--prefill 0 only works with --mode colocated, not {self.mode}")
        if max(self.num_prefill, self.num_decode) > MAX_WORKERS_PER_ROLE:
            raise ValueError(f"at most {MAX_WORKERS_PER_ROLE} workers of each role per node")
        check_tensor_parallel(self.mode, self.tp, not self.is_cpu)
        if self.is_cpu and self.num_gpus is not None:
            raise ValueError("--gpus and --cpu exclude each other")
        if not self.is_cpu and self.num_gpus is not None and self.num_gpus < self.num_ranks:
            raise ValueError(
                f"the shape does not fit: {self.num_prefill} prefill + {self.num_decode} decode "
                f"workers need {self.num_ranks} GPUs ({self._gpus_each}), "
                f"but --gpus is {self.num_gpus}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.host_cores < 0:
            raise ValueError(f"--host-cores must be >= 0 (0: no pinning), got {self.host_cores}")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def tp(self) -> dict[str, int]:
        """Each role's tensor-parallel size: its workers' ranks, and GPUs on GPU."""
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}

    @property
    def num_ranks(self) -> int:
        """Tensor-parallel ranks of every worker together: the GPUs they need."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def _gpus_each(self) -> str:
        counts = {"prefill": self.num_prefill, "decode": self.num_decode}
        sizes = {role: tp for role, tp in self.tp.items() if counts[role]}
        if set(sizes.values()) == {1}:
            return "one each"
        return ", ".join(f"{tp} per {role} worker" for role, tp in sizes.items())

    @property
    def image_name(self) -> str:
        return self.image or ("pdserve:cpu" if self.is_cpu else "pdserve:latest")

    @property
    def cpu_plan(self) -> CpuPlan | None:
        if not self.host_cores:
            return None
        cores = list(range(self.host_cores))
        return plan_cores(self.num_prefill, self.num_decode, cores, self.prefill_tp, self.decode_tp)

    def command_line(self) -> str:
        """The generator's command that reproduces this shape (the file's first line)."""
        gpus = "--cpu" if self.is_cpu else f"--gpus {self.num_gpus or self.num_ranks}"
        args = [f"--prefill {self.num_prefill}", f"--decode {self.num_decode}", gpus]
        options = [
            ("prefill-tp", None if self.prefill_tp == 1 else self.prefill_tp),
            ("decode-tp", None if self.decode_tp == 1 else self.decode_tp),
            ("image", self.image),
            ("model-dir", self.model_dir),
            ("kv-cache-memory", self.kv_cache_memory),
            ("mode", None if self.mode == "pull" else self.mode),
            ("port", None if self.port == PROXY_PORT else self.port),
            ("host-cores", self.host_cores),
        ]
        args += [f"--{name} {value}" for name, value in options if value is not None]
        return "python -m deploy.compose " + " ".join(args)


@dataclass(frozen=True)
class WorkerService:
    """One worker service: a GPU worker, or on CPU every replica of one role."""

    role: str
    name: str
    port: int
    num_replicas: int = 1

    @property
    def pool_entry(self) -> str:
        """How the proxy finds it: one URL, or every replica's address through Docker's DNS."""
        scheme = "dns" if self.name == self.role else "http"
        return f"{scheme}://{self.name}:{self.port}"


KV_EVENTS_PORT = 5557  # and the next port: replay


def worker_services(shape: Shape) -> list[WorkerService]:
    """Every worker service, prefill first: prefill-0, ..., decode-0, ... on GPU; on CPU one
    service per role, named after it."""
    counts = {"prefill": shape.num_prefill, "decode": shape.num_decode}
    if shape.is_cpu:
        return [WorkerService(r, r, BASE_PORTS[r], n) for r, n in counts.items() if n]
    return [
        WorkerService(role, f"{role}-{i}", BASE_PORTS[role] + i)
        for role, n in counts.items()
        for i in range(n)
    ]


def worker_cpu(shape: Shape, worker: WorkerService) -> tuple[int | None, dict]:
    """The worker's torch threads and the service keys that give it as many cores: its own
    `cpuset` on GPU; on CPU a `cpus` quota, the fewest cores the plan gives a worker of its role
    (a replica has no cores of its own)."""
    plan = shape.cpu_plan
    if plan is None:
        return None, {}
    if not shape.is_cpu:
        cpu = plan.workers[worker.name]
        return cpu.num_threads, {"cpuset": cpu.cpu_list}
    num_threads = min(
        cpu.num_threads for name, cpu in plan.workers.items() if name.startswith(f"{worker.role}-")
    )
    return num_threads, {"cpus": num_threads}


def healthcheck(port: int) -> dict:
    probe = f'import urllib.request as r; r.urlopen("http://127.0.0.1:{port}/health", timeout=4)'
    # start_period covers preparing the default model on first start and loading weights
    return {
        "test": Flow(["CMD", "python", "-c", probe]),
        "interval": "10s",
        "timeout": "5s",
        "retries": 3,
        "start_period": "600s",
    }


def worker_service(shape: Shape, worker: WorkerService, gpus: list[int] | None) -> dict:
    """The worker's service; `gpus`: its own GPUs, one per tensor-parallel rank (None on CPU),
    among the node's that every worker container sees."""
    device = ["--device", "cpu", "--dtype", "float32"] if shape.is_cpu else ["--device", "cuda"]
    kv_host = "auto" if shape.is_cpu else worker.name  # auto: each replica's own container IP
    command = ["python", "-m", f"{worker.role}_server", "--host", "0.0.0.0"]
    command += ["--port", str(worker.port), "--kv-host", kv_host, *device]
    # KV events on the container's own network, for the proxy's KV-aware routing
    command += ["--kv-events-endpoint", f"tcp://*:{KV_EVENTS_PORT}"]
    command += ["--kv-events-replay-endpoint", f"tcp://*:{KV_EVENTS_PORT + 1}"]
    command += ["--kv-events-require-curve"]  # its keys: the secrets below
    command += tp_args(shape.tp[worker.role])  # TP > 1: colocated only (deploy/tp.py)
    volumes = [f"{CACHE_VOLUME}:{CACHE_DIR}"]
    if shape.model_dir:
        command += ["--model", MODEL_MOUNT]
        volumes.append(f"{shape.model_dir}:{MODEL_MOUNT}:ro")
    if shape.kv_cache_memory:
        command += ["--kv-cache-memory", shape.kv_cache_memory]
    num_threads, cores = worker_cpu(shape, worker)
    if num_threads is not None:  # sizes torch to the cores the service keys below give it
        command += ["--cpu-threads", str(num_threads)]
    gpu_only, gpu_env = {}, {}
    if gpus is not None:  # a TP-N worker's N GPUs: its ranks' cuda:0..N-1
        gpu_only = {"ipc": "host", "ulimits": {"memlock": -1}}  # RDMA registration pins memory
        visible = ",".join(str(i) for i in gpus)
        gpu_env = {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    service = {
        "image": shape.image_name,
        "command": Flow(command),
        **({"scale": worker.num_replicas} if worker.num_replicas > 1 else {}),
        "restart": "unless-stopped",
        "environment": {
            "PDSERVE_CACHE_DIR": CACHE_DIR,
            # the compiled forward's kernels: a restarted worker skips most of the compile
            "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/inductor",
            # the C kernels: built by each container for itself (~1 s each), never shared, so
            # no service can plant code that another one runs
            "PDSERVE_KERNEL_CACHE_DIR": KERNEL_DIR,
            "PDSERVE_INTERNAL_TOKEN": TOKEN,
            "UCX_TLS": UCX_TLS["cpu" if shape.is_cpu else "cuda"],
            "UCX_NET_DEVICES": "eth0",
            "NIXL_LOG_LEVEL": "WARN",
            **gpu_env,
            **key_files(WORKER_KEYS),
        },
        "secrets": Flow(WORKER_KEYS.values()),
        "volumes": volumes,
        "expose": [str(worker.port)],
        **cores,
        "pid": "host",
        **gpu_only,
        "cap_add": Flow(["SYS_PTRACE"]),
        "stop_grace_period": "35s",  # the workers' --drain-timeout is 30 s
        "healthcheck": healthcheck(worker.port),
    }
    if gpus is not None:  # every worker's GPUs: the peers' too, for CUDA IPC (see the top)
        every = Flow([str(i) for i in range(shape.num_ranks)])
        device = {"driver": "nvidia", "device_ids": every, "capabilities": Flow(["gpu"])}
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    return service


def key_files(variables: dict[str, str]) -> dict[str, str]:
    """Each `_FILE` variable naming its secret's file, where compose mounts it."""
    return {variable: f"/run/secrets/{secret}" for variable, secret in variables.items()}


def proxy_service(shape: Shape, workers: list[WorkerService]) -> dict:
    command = ["python", "-m", "proxy", "--host", "0.0.0.0", "--port", str(PROXY_PORT)]
    command += ["--mode", shape.mode]
    for worker in workers:
        command += [f"--{worker.role}", worker.pool_entry]
    if shape.is_cpu:
        command += ["--discovery-interval", str(DISCOVERY_INTERVAL)]
    return {
        "image": shape.image_name,
        "command": command,
        "restart": "unless-stopped",
        "environment": {"PDSERVE_INTERNAL_TOKEN": TOKEN, **key_files(PROXY_KEYS)},
        "secrets": Flow(PROXY_KEYS.values()),
        "ports": [f"{shape.port}:{PROXY_PORT}"],
        "stop_grace_period": "35s",
        "healthcheck": healthcheck(PROXY_PORT),
        "depends_on": {w.name: {"condition": "service_healthy"} for w in workers},
    }


def build_compose(shape: Shape) -> dict:
    """The compose document as a dict (services in order: prefill, decode, proxy, then the
    `monitoring` profile's Prometheus and Grafana, which start only with `--profile monitoring`)."""
    workers = worker_services(shape)
    services, first_gpu = {}, 0
    for worker in workers:  # GPU: consecutive GPUs, as many as the worker has ranks
        num_gpus = shape.tp[worker.role]
        gpus = None if shape.is_cpu else list(range(first_gpu, first_gpu + num_gpus))
        services[worker.name] = worker_service(shape, worker, gpus)
        first_gpu += num_gpus
    services["proxy"] = proxy_service(shape, workers)
    targets = {"proxy": [f"http://proxy:{PROXY_PORT}"]}  # the monitoring profile's scrapes
    for role in BASE_PORTS:
        targets[role] = [w.pool_entry for w in workers if w.role == role]
    services.update(monitoring.services(targets))
    env = services["prometheus"]["environment"]
    env[monitoring.CONFIG_VARIABLE] = Block(env[monitoring.CONFIG_VARIABLE])
    return {
        "services": services,
        "volumes": {CACHE_VOLUME: {}, monitoring.DATA_VOLUME: {}},
        "secrets": {name: {"file": f"{KEYS_DIR}/{f}"} for name, f in KEY_SECRETS.items()},
    }


def render(shape: Shape) -> str:
    header = (
        f"# Generated by: {shape.command_line()}\n"
        "# Edit deploy/compose.py, not this file. Start: docs/deploy.md.\n"
    )
    return header + yaml.dump(build_compose(shape), Dumper=_Dumper, sort_keys=False, width=200)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.compose", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--prefill", type=int, default=1, help="prefill workers (default 1)")
    add("--decode", type=int, default=1, help="decode workers (default 1)")
    add("--gpus", type=int, default=None, help="GPUs on the node (default: one per TP rank)")
    add_tp_args(add, default=None)  # a TP-N worker: N GPUs of its own
    add(
        "--gpus-per-worker",
        type=int,
        default=None,
        metavar="N",
        help="short for --prefill-tp N --decode-tp N (a worker's GPUs are its ranks)",
    )
    add("--cpu", action="store_true", help="no GPUs: --device cpu, float32, image pdserve:cpu")
    add("--image", default=None, help="image of every service (default pdserve:latest or :cpu)")
    add(
        "--model-dir",
        default=None,
        help="host folder of an HF model, mounted read-only "
        "(default: the built-in SmolLM2-135M-Instruct, prepared into a volume on first start)",
    )
    add("--kv-cache-memory", default=None, help="each worker's KV cache budget, e.g. 40GiB")
    add("--mode", default="pull", choices=MODES, help="the proxy's mode (default pull)")
    add("--port", type=int, default=PROXY_PORT, help="the proxy's port on the host (8000)")
    add(
        "--host-cores",
        type=int,
        default=os.cpu_count(),
        metavar="N",
        help="the host's cores, split among the workers as cpusets with one torch thread per "
        "core, prefill and decode apart (default: this machine's, %(default)s; 0: no pinning)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.gpus_per_worker is not None and (a.prefill_tp, a.decode_tp) != (None, None):
        parser.error("--gpus-per-worker N is short for --prefill-tp N --decode-tp N: give either")
    each = 1 if a.gpus_per_worker is None else a.gpus_per_worker
    tp = {"prefill": a.prefill_tp, "decode": a.decode_tp}
    tp = {role: each if size is None else size for role, size in tp.items()}
    try:
        shape = Shape(
            num_prefill=a.prefill,
            num_decode=a.decode,
            num_gpus=a.gpus,
            is_cpu=a.cpu,
            prefill_tp=tp["prefill"],
            decode_tp=tp["decode"],
            image=a.image,
            model_dir=a.model_dir,
            kv_cache_memory=a.kv_cache_memory,
            mode=a.mode,
            port=a.port,
            host_cores=a.host_cores,
        )
    except ValueError as e:
        parser.error(str(e))  # exit 2
    for warning in shape.cpu_plan.warnings if shape.cpu_plan is not None else []:
        print(f"warning: {warning}", file=sys.stderr)
    sys.stdout.write(render(shape))


if __name__ == "__main__":
    main()
