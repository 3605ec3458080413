"""Engines measured side by side, interleaved: each one a long-lived child process that loads its
model and warms up once, then runs one timed batch per request.

The line protocol (stdin/stdout), the same for every side:
- the child prints `PEER READY {json}` once it has warmed up: every batch size once at
  `WARMUP_TOKENS` new tokens, the same work on every side;
- the parent writes a batch size `C`; the child generates the first C prompts, `--new-tokens`
  each, greedy, EOS ignored, and prints `PEER RESULT {"batch": C, "tok_s": ...}`;
- `quit` (or EOF) ends it.
Everything else a child prints goes to its log file. `interleave()` runs the rounds: each round
every batch size on every side, the sides' order rotating from round to round, so that drift of
the machine (other load, thermal, the neighbour's memory traffic) spreads over all of them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

WARMUP_TOKENS = 8
START_TIMEOUT_S = 900.0  # vLLM's first start compiles for minutes
PREFIX = "PEER "


@dataclass
class Peer:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    info: dict = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _log: object = None

    def start(self) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open for the child's life
        self._proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self.info = self._expect("READY", START_TIMEOUT_S)

    def run(self, batch: int) -> float:
        self._proc.stdin.write(f"{batch}\n")
        self._proc.stdin.flush()
        result = self._expect("RESULT", START_TIMEOUT_S)
        assert result["batch"] == batch, result
        return result["tok_s"]

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write("quit\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._proc = None

    def _expect(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self._proc.stdout.readline()
            if not line:
                code = self._proc.wait()
                raise RuntimeError(f"{self.name} exited ({code}); log: {self.log_path}")
            if line.startswith(PREFIX + kind + " "):
                return json.loads(line.removeprefix(PREFIX + kind + " "))
            self._log.write(line)
        raise TimeoutError(f"{self.name}: no {kind} in {timeout:.0f} s; log: {self.log_path}")


def serve(generate: Callable[[int, int], None], info: dict) -> None:
    """The child's side: `generate(batch, new_tokens)` runs (and checks) one batch; this warms
    each batch size up, then answers the parent's requests."""
    args = json.loads(os.environ["PEER_ARGS"])
    for batch in args["concurrency"]:
        generate(batch, WARMUP_TOKENS)
    print(PREFIX + "READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() in ("", "quit"):
            break
        batch = int(line)
        start = time.perf_counter()
        generate(batch, args["new_tokens"])
        tok_s = batch * args["new_tokens"] / (time.perf_counter() - start)
        print(PREFIX + "RESULT " + json.dumps({"batch": batch, "tok_s": tok_s}), flush=True)


def peer_env(concurrency: list[int], new_tokens: int, **extra: str) -> dict[str, str]:
    args = json.dumps({"concurrency": concurrency, "new_tokens": new_tokens})
    return dict(os.environ, PEER_ARGS=args, **extra)


def interleave(peers: list[Peer], concurrency: list[int], rounds: int) -> dict:
    """{peer name: {batch: [tok/s per round]}}; prints each result as it comes."""
    results = {p.name: {c: [] for c in concurrency} for p in peers}
    for r in range(rounds):
        order = peers[r % len(peers) :] + peers[: r % len(peers)]
        for c in concurrency:
            for peer in order:
                tok_s = peer.run(c)
                results[peer.name][c].append(tok_s)
                print(f"  round {r + 1}, batch {c}, {peer.name}: {tok_s:.1f} tok/s", flush=True)
    return results


def spread(values: list[float]) -> str:
    """'median [min-max]'."""
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


# what makes this machine run another instruction set's code (common/native/build.py)
ISA_LIMITS = ("PDSERVE_KERNEL_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def machine_header() -> str:
    """The CPU, the flags that choose kernels, the commit and the load: what a figure needs."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    root = Path(__file__).resolve().parents[2]
    commit = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    limits = [f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k)]
    return (
        f"cpu: {model}; {os.cpu_count()} cores; flags: {' '.join(isa) or 'none of avx2/avx512'}\n"
        + (f"instruction sets limited: {' '.join(limits)}\n" if limits else "")
        + f"commit: {commit or 'unknown'}; load average (1/5/15 min): {load}"
    )
