"""A worker's cold start: process start to `/health` 200, compiled (inductor's cache empty, then
warm) and eager, on the built-in model at its default dtype.

Each case starts `python -m decode_server` on a free loopback port, polls `/health` every 50 ms,
reads `pdserve_model_compile_seconds` from `/metrics`, and stops the worker. The compiled cases
use a fresh `TORCHINDUCTOR_CACHE_DIR` for the cold start and the same one again for the warm.

    python benchmarks/cold_start.py [--dtype auto] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_health(args: list[str], env: dict[str, str], timeout: float = 300.0) -> tuple:
    """(seconds to /health 200, compile seconds) of one worker start."""
    port = free_port()
    cmd = [sys.executable, "-m", "decode_server", "--port", str(port), *args]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - start
                    metrics = httpx.get(f"{url}/metrics", timeout=5).text
                    return ready, _sample(metrics, "pdserve_model_compile_seconds")
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"no /health 200 in {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    a = parser.parse_args()
    args = ["--dtype", a.dtype] + (["--model", a.model] if a.model else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        compiled_env = dict(env, TORCHINDUCTOR_CACHE_DIR=cache)
        rows.append(("compiled, cold cache", *start_to_health(args, compiled_env)))
        rows.append(("compiled, warm cache", *start_to_health(args, compiled_env)))
    rows.append(("eager", *start_to_health([*args, "--enforce-eager"], env)))
    print(f"{'case':<22} | {'start to /health s':>18} | {'of it compile s':>15}")
    for name, ready, compile_s in rows:
        print(f"{name:<22} | {ready:>18.1f} | {compile_s:>15.1f}")


if __name__ == "__main__":
    main()
