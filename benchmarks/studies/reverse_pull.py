"""The reverse pull's cost model, measured on this box: is reading a prompt prefix from D over
NIXL cheaper than computing it on P, and from how many tokens on?

One P and one D as `deploy.local` starts them (one core each, KV events on, pull) and two proxies
in front of the same workers, which differ only in `--reverse-pull-min-tokens`:

    recompute   0: P computes the whole prompt (what the project did before the reverse pull)
    reverse     1: P reads every whole block of the prefix D holds, and computes the rest

For each prefix length L, each round: a fresh prefix of L random token ids is cached on D (one
request straight to D), the proxy's index of D is waited for, then a prompt of that prefix and
`--suffix` new tokens goes through one proxy, and the same through the other with another fresh
prefix (the order alternates by round). The time measured is the whole non-streamed request with
`max_tokens` 1: the proxy, P's prefill (with the read or without) and D's answer, which needs no
KV. Medians over the rounds, interleaved; the ratio reverse/recompute of each length; and what
the reverse pull saves a token of prefix, from which `--reverse-pull-min-tokens`' default comes.

    .venv/bin/python -m benchmarks.studies.reverse_pull [--rounds 5]
        [--lengths 16 32 64 128 256 512]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time

import httpx

from benchmarks.cluster import Bench, LocalConfig

QUIET = ("--log-level", "warning")
FLAG = "--reverse-pull-min-tokens"
NO_D_ALONE = ("--cached-on-decode-tokens", "0")  # a short suffix through P all the same
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary tokens of the default model's vocabulary


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--suffix", type=int, default=16, help="new tokens after the prefix")
    p.add_argument("--model", help="an HF-format folder (default: the built-in default model)")
    args = p.parse_args()
    if args.rounds < 1 or args.suffix < 1 or any(n < 16 or n % 16 for n in args.lengths):
        p.error("--rounds and --suffix must be >= 1, --lengths whole 16-token blocks")
    return args


def start(bench: Bench, model: str | None) -> tuple[str, dict[str, str]]:
    """D's URL and each proxy's."""
    cfg = LocalConfig(model=model, port=0, worker_args=QUIET, proxy_args=QUIET, is_kv_events=True)
    cluster = bench.cluster(cfg)
    proxies = {
        name: bench.proxy(name, cluster, cfg, [*QUIET, *NO_D_ALONE, FLAG, str(min_tokens)])
        for name, min_tokens in (("recompute", 0), ("reverse", 1))
    }
    bench.wait_ready(cluster)
    for proxy in proxies.values():
        bench.wait_ok(f"{proxy.url}/ready")
    return cluster.workers["decode"][0].url, {k: v.url for k, v in proxies.items()}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and name.endswith("}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(url: str, prompt: list[int]) -> float:
    """Seconds for a non-streamed request of one token."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - started


def indexed(proxy: str, decode: str) -> float:
    return metric(proxy, f'pdserve_proxy_kv_index_blocks{{role="decode",url="{decode}"}}')


def one(decode: str, proxy: str, rng: random.Random, length: int, suffix: int) -> float:
    """A fresh prefix cached on D, then a prompt that extends it through `proxy`."""
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]
    before = indexed(proxy, decode)
    complete(decode, prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH)])
    deadline = time.monotonic() + 30
    while indexed(proxy, decode) < before + length // 16:
        if time.monotonic() > deadline:
            raise SystemExit(f"the proxy never saw D cache {length} tokens")
        time.sleep(0.02)
    return complete(proxy, prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(suffix)])


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    args = parse_args()
    started, load_start = time.monotonic(), os.getloadavg()[0]
    rng = random.Random(0)
    times: dict[int, dict[str, list[float]]] = {
        n: {"recompute": [], "reverse": []} for n in args.lengths
    }
    with Bench("reverse_pull") as bench:
        decode, proxies = start(bench, args.model)
        for url in proxies.values():  # warm-up: compiled shapes, peers met
            for _ in range(2):
                one(decode, url, rng, 32, args.suffix)
        lent = metric(proxies["reverse"], 'pdserve_proxy_reverse_pulls_total{outcome="lent"}')
        for r in range(args.rounds):
            for length in args.lengths:
                order = list(proxies) if r % 2 == 0 else list(proxies)[::-1]
                for system in order:
                    bench.check_alive()
                    times[length][system].append(
                        one(decode, proxies[system], rng, length, args.suffix)
                    )
        lent = (
            metric(proxies["reverse"], 'pdserve_proxy_reverse_pulls_total{outcome="lent"}') - lent
        )
    report(args, times, lent, started, load_start)


def report(args, times: dict, lent: float, started: float, load_start: float) -> None:
    minutes = (time.monotonic() - started) / 60
    load_end = os.getloadavg()[0]
    print(f"\n## The reverse pull vs computing the prefix on P ({args.rounds} rounds)")
    print(f"commit {commit()}; {minutes:.1f} min; load average {load_start:.2f} to {load_end:.2f}")
    print(
        f"suffix {args.suffix} tokens; prefixes lent by D: {lent:.0f} of {args.rounds * len(times)}"
    )
    print("\n| prefix tokens | recompute (ms) | reverse (ms) | reverse/recompute | saved a token |")
    print("|---:|---:|---:|---:|---:|")
    for length, by in times.items():
        a, b = statistics.median(by["recompute"]), statistics.median(by["reverse"])
        print(
            f"| {length} | {a * 1e3:.1f} ({_span(by['recompute'])}) | {b * 1e3:.1f} "
            f"({_span(by['reverse'])}) | {b / a:.2f} | {(a - b) * 1e3 / length:.2f} ms |"
        )


def _span(seconds: list[float]) -> str:
    return f"{min(seconds) * 1e3:.0f}–{max(seconds) * 1e3:.0f}"


if __name__ == "__main__":
    main()
