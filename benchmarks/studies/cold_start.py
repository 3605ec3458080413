"""A worker's cold start: process start to `/health` 200, compiled (inductor's cache empty, then
warm) and eager, on the built-in model at its default dtype.

Each case starts `python -m decode_server` on a free loopback port, polls `/health` every 0.1 s,
reads `pdserve_model_compile_seconds` from `/metrics`, and stops the worker. The compiled cases
use a fresh `TORCHINDUCTOR_CACHE_DIR` for the cold start and the same one again for the warm.

    python benchmarks/studies/cold_start.py [--dtype auto] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deploy.processes import ServerProcess  # noqa: E402


def start_to_health(args: list[str], logs: Path, timeout: float = 300.0) -> tuple:
    """(seconds to /health 200, compile seconds) of one worker start."""
    start = time.perf_counter()
    worker = ServerProcess("decode", args, logs / "decode.log")
    try:
        worker.wait_ready(timeout)
        return time.perf_counter() - start, worker.metric("pdserve_model_compile_seconds")
    finally:
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    a = parser.parse_args()
    args = ["--dtype", a.dtype] + (["--model", a.model] if a.model else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(logs / "inductor")  # the workers inherit it
        rows.append(("compiled, cold cache", *start_to_health(args, logs)))
        rows.append(("compiled, warm cache", *start_to_health(args, logs)))
        rows.append(("eager", *start_to_health([*args, "--enforce-eager"], logs)))
    print(f"{'case':<22} | {'start to /health s':>18} | {'of it compile s':>15}")
    for name, ready, compile_s in rows:
        print(f"{name:<22} | {ready:>18.1f} | {compile_s:>15.1f}")


if __name__ == "__main__":
    main()
