"""What a proxy costs: this proxy vs the Rust `vllm-router` (`--vllm-pd-disaggregation`), both in
front of the same instant stub workers (benchmarks/proxy_stubs.py: a P that returns transfer
params, a D that streams 16 chunks), loaded by `wrk` (C, so the load generator costs little).

For each target and concurrency: requests/s, p50 and p99 latency of a streamed completion, and
errors; "direct D" is the floor (the client streams from the D stub itself, no proxy). Both proxies
route round robin. The router is installed into its own virtualenv (benchmarks/peers/vllm_cpu.py).

    .venv/bin/python benchmarks/studies/bench_proxy.py [--duration 5] [--repeats 3]
        [--concurrency 1 32]
        [--proxy-workers 1 2] [--http-clients lean httpx]

pdserve runs once per `--workers` value and HTTP client to the workers (its hand-written lean
transport, or httpx's own), each against the router in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/studies/bench_proxy.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from benchmarks.cluster import ROOT, Bench, free_port  # noqa: E402
from benchmarks.peers.vllm_cpu import ROUTER_VERSION, ensure_router  # noqa: E402

BODY = {"model": "stub", "prompt": "hello world", "max_tokens": 16, "stream": True}
_LUA = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""


def ensure_wrk() -> str:
    if shutil.which("wrk") is None:
        print("installing wrk (Debian package) ...", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=False, capture_output=True)
    path = shutil.which("wrk")
    if path is None:
        sys.exit("bench_proxy needs wrk: apt-get install wrk")
    return path


def wait_serving(url: str, bench: Bench, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        bench.check_alive()
        try:
            if httpx.post(url, json=BODY, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not serve in {timeout}s")


def run_wrk(wrk: str, url: str, concurrency: int, duration: float, script: Path) -> dict:
    seconds = max(1, round(duration))
    cmd = [wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    if re.search(r"^\s*99%\s+[\d.]+(us|ms|s|m)\b", out, re.M) is None:
        sys.exit(f"wrk against {url} gave no latencies:\n{out}")
    errors = sum(int(n) for n in re.findall(r"(?:Non-2xx or 3xx responses|timeout) (\d+)", out))
    errors += sum(int(n) for n in re.findall(r"(?:connect|read|write) (\d+)", out))
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),
        "p50_ms": _ms(re.search(r"^\s*50%\s+(\S+)", out, re.M)[1]),  # not a "90.50%" of Stdev
        "p99_ms": _ms(re.search(r"^\s*99%\s+(\S+)", out, re.M)[1]),
        "errors": errors,
    }


def _median(rows: list[dict]) -> dict:
    """Per metric, the median over repeats."""
    return {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    assert match, f"not a wrk latency: {text!r}"
    value, unit = match.groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}[unit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported")
    ap.add_argument("--router-version", default=ROUTER_VERSION)
    ap.add_argument(
        "--proxy-workers", type=int, nargs="+", default=[1, 2], help="pdserve's --workers values"
    )
    ap.add_argument(
        "--http-clients",
        nargs="+",
        default=["lean", "httpx"],
        choices=["lean", "httpx"],
        help="pdserve's --http-client values (each with each --proxy-workers)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    wrk, router = ensure_wrk(), ensure_router(a.router_version)
    ports = {name: free_port() for name in ("prefill", "decode", "router", "metrics")}
    p_url, d_url = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
    bench = Bench("bench_proxy")
    script = bench.log_dir / "post.lua"
    script.write_text(_LUA.format(body=json.dumps(BODY)))
    stub = [sys.executable, str(ROOT / "benchmarks" / "proxy_stubs.py")]
    bench.start("stub_prefill", [*stub, "prefill", "--port", str(ports["prefill"])])
    bench.start("stub_decode", [*stub, "decode", "--port", str(ports["decode"])])
    targets = {"direct D (floor)": f"{d_url}/v1/completions"}
    for n in a.proxy_workers:
        for client in a.http_clients:
            name, port = f"pdserve ×{n} {client}", free_port()
            bench.start(name, [
                sys.executable, "-m", "proxy", "--prefill", p_url, "--decode", d_url,
                "--port", str(port), "--log-level", "warning", "--workers", str(n),
                "--http-client", client,
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
            ])  # fmt: skip
            targets[name] = f"http://127.0.0.1:{port}/v1/completions"
    bench.start("router", [
        str(router), "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url,
        "--port", str(ports["router"]), "--policy", "round_robin", "--log-level", "warning",
        "--prometheus-port", str(ports["metrics"]),
    ])  # fmt: skip
    targets["vllm-router"] = f"http://127.0.0.1:{ports['router']}/v1/completions"
    results: dict[str, dict[int, dict]] = {}
    with bench:
        for url in targets.values():
            wait_serving(url, bench)
        for url in targets.values():
            run_wrk(wrk, url, 4, 1.0, script)  # warm-up: connections, caches
        runs: dict[tuple[str, int], list[dict]] = {}
        for _ in range(a.repeats):  # interleaved, so that a noisy moment hits every target
            for c in a.concurrency:
                for name, url in targets.items():
                    runs.setdefault((name, c), []).append(run_wrk(wrk, url, c, a.duration, script))
        for (name, c), rows in runs.items():
            results.setdefault(name, {})[c] = _median(rows)
    report(results, a.concurrency, a.duration, a.repeats)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


def report(results: dict, concurrencies: list[int], duration: float, repeats: int) -> None:
    print(f"\nstreamed completions, 16 chunks, wrk -t1, medians of {repeats} interleaved "
          f"{duration:.0f}-s runs\n")  # fmt: skip
    print("| target | concurrency | req/s | p50 ms | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        for c in concurrencies:
            r = rows[c]
            print(f"| {name} | {c} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                  f"| {r['errors']} |")  # fmt: skip
    peer, floor = results["vllm-router"], results["direct D (floor)"]
    print("\n| pdserve | concurrency | req/s pdserve / router | p50 pdserve − router (ms) "
          "| p50 added over direct D: pdserve / router (ms) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for name in (k for k in results if k.startswith("pdserve")):
        for c in concurrencies:
            o, p, f = results[name][c], peer[c], floor[c]
            added = f"{o['p50_ms'] - f['p50_ms']:.2f} / {p['p50_ms'] - f['p50_ms']:.2f}"
            print(f"| {name} | {c} | {o['rps'] / p['rps']:.2f} "
                  f"| {o['p50_ms'] - p['p50_ms']:+.2f} | {added} |")  # fmt: skip


if __name__ == "__main__":
    main()
