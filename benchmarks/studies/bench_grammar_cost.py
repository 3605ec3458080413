"""A grammar's cost to the other streams of its worker: a plain stream's longest gap between
tokens alone, and while a client sends pathological grammars to the same decode worker.

One decode worker (colocated, loopback, eager, the default model unless `--model`), started from
`--root` (default: this tree; a checkout of an older commit measures the code before a change).
In each round, in a rotating order, the victim (a streamed completion, greedy, `--tokens`
tokens, EOS ignored) runs alone and beside each attacker; an attacker sends its request (n = 4,
64 tokens) again and again, one at a time (0.1 s apart after a refusal: one request at its limit,
not a flood of 400s), from 0.3 s before the victim starts until it ends.

- `nested`: `((a{70}){70}){70}`, the regex that passed admission in 1 ms and then cost 0.8 s on
  its first step and ~0.1 s on each one after (stalled other streams 3.15 s at n = 4).
- `at-limit`: `((a{20}){20}){20}`, whose masks cost ~15 ms a step for SmolLM2's vocabulary:
  admitted, and running near the default mask budget (20 ms).

Printed: per mode, the victim's longest gap (ms) median [min-max] over the rounds, its ratio to
the median alone, and what the attacker's requests got (status: count).

    python -m benchmarks.studies.bench_grammar_cost [--rounds 3] [--root /tmp/old-checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.peers.protocol import machine_header, spread
from deploy.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
ATTACKS = {"nested": "((a{70}){70}){70}", "at-limit": "((a{20}){20}){20}"}
LEAD_S = 0.3  # the attacker starts this long before the victim
REFUSED_PAUSE_S = 0.1


def start_worker(root: Path, model: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "decode_server", "--port", str(port), "--enforce-eager"]
    cmd += ["--model", model] if model else []
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(log.read_text()[-3000:])


def victim_gap(url: str, tokens: int) -> float:
    """The longest gap (s) between two token-carrying events of a streamed completion."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    assert len(times) > 1, "the victim got no tokens"
    return max(b - a for a, b in zip(times, times[1:]))


def attack(url: str, regex: str, stop: threading.Event, outcomes: Counter) -> None:
    body = {"prompt": "a", "max_tokens": 64, "temperature": 0, "n": 4, "guided_regex": regex}
    while not stop.is_set():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        code = r.json()["error"].get("code") if r.status_code != 200 else ""
        outcomes[f"{r.status_code} {code}".strip()] += 1
        if r.status_code != 200:
            stop.wait(REFUSED_PAUSE_S)


def run_mode(url: str, mode: str, tokens: int) -> tuple[float, Counter]:
    outcomes: Counter = Counter()
    if mode == "alone":
        return victim_gap(url, tokens), outcomes
    stop = threading.Event()
    attacker = threading.Thread(target=attack, args=(url, ATTACKS[mode], stop, outcomes))
    attacker.start()
    time.sleep(LEAD_S)
    try:
        return victim_gap(url, tokens), outcomes
    finally:
        stop.set()
        attacker.join(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree the worker runs")
    parser.add_argument("--model", help="model folder (default: the worker's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="the victim's tokens")
    args = parser.parse_args()
    print(machine_header())
    log = Path(tempfile.mkdtemp(prefix="grammar-cost-")) / "decode.log"
    proc, url = start_worker(args.root.resolve(), args.model, log)
    modes = ["alone", *ATTACKS]
    gaps: dict[str, list[float]] = {m: [] for m in modes}
    outcomes: dict[str, Counter] = {m: Counter() for m in modes}
    try:
        victim_gap(url, 8)  # warm-up
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                gap, got = run_mode(url, mode, args.tokens)
                gaps[mode].append(gap * 1e3)
                outcomes[mode] += got
                print(f"  round {r + 1}, {mode}: longest gap {gap * 1e3:.0f} ms {dict(got)}")
    finally:
        proc.terminate()
        proc.wait(30)
    alone = statistics.median(gaps["alone"])
    print(f"\nvictim's longest gap (ms), {args.rounds} rounds, {args.tokens} tokens; {args.root}")
    for mode in modes:
        ratio = statistics.median(gaps[mode]) / alone
        print(f"  {mode:<9} {spread(gaps[mode]):<24} {ratio:>5.2f}x  {dict(outcomes[mode])}")
    print(machine_header())


if __name__ == "__main__":
    main()
