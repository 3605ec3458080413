"""Soak: a bounded stretch of streamed load with client aborts through the proxy in front of
2 prefill + 2 decode workers, then the ledger: requests, errors by reason, hangs, leaked KV
blocks, worker RSS growth.

64 clients loop until `--duration` is over: each sends a streamed chat or completion (random
words, 16–64 new tokens) and, with probability `--abort-rate`, closes the stream after a few
chunks. A request that has not ended `--deadline` seconds after it began is a hang. RSS is
read from /proc after a warm-up (allocators settle) and at the end; leaked blocks are what the
workers' `pdserve_kv_blocks_used` still counts once the load has stopped and leases could expire.
Exit status 1 when anything leaked, hung, or an RSS grew 5% or more.

With `--rolling-restarts N` the decode workers run with `--drain-migrate`, and N times during
the load (evenly spaced) one of them, in turn, is SIGTERM'd and started again on its port: a
rolling restart under load, which lasts at least until the last one is healthy again. Its
requests move to the other D (proxy/journey/migration.py), so every request must still end well: the
ledger adds each restart's exit status and seconds to exit, and any error then also makes the
exit status 1.

    .venv/bin/python benchmarks/studies/soak.py [--duration 600] [--clients 64] [--abort-rate 0.1]
    .venv/bin/python benchmarks/studies/soak.py --duration 60 --warmup 10 --rolling-restarts 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import Bench, Cluster, LocalConfig  # noqa: E402
from common.processes import Child  # noqa: E402
from deploy.processes import metric, wait_until  # noqa: E402

WORDS = ["the", "of", "prefill", "decode", "cache", "block", "layer", "token", "stream", "model"]
WORDS += ["serve", "river", "sky", "blue", "why", "is", "green", "how", "many", "layers"]


def start_cluster(bench: Bench, model_args: list[str], decode_args: tuple[str, ...]) -> Cluster:
    """deploy.local's cluster (KV events and all), 2 P + 2 D floating over every core."""
    cfg = LocalConfig(
        decode_args=decode_args,
        num_prefill=2,
        num_decode=2,
        is_cpu_split=False,
        worker_args=(*model_args, "--max-model-len", "512", "--kv-lease-timeout", "20",
                     "--dtype", "float32"),  # as the P/D tests: fp32 on every CPU
        proxy_args=("--health-interval", "1"),
    )  # fmt: skip
    cluster = bench.cluster(cfg)
    bench.wait_ready(cluster)
    return cluster


async def one_request(client: httpx.AsyncClient, rng: random.Random, abort_rate: float) -> str:
    words = " ".join(rng.choices(WORDS, k=rng.randint(5, 120)))
    chat = rng.random() < 0.5
    body = {"max_tokens": rng.randint(16, 64), "stream": True, "ignore_eos": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    else:
        path, body["prompt"] = "/v1/completions", words
    abort_after = rng.randint(1, 8) if rng.random() < abort_rate else None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"http_{r.status_code}"
        num_events = 0
        async for line in r.aiter_lines():
            if line.startswith('data: {"error"'):
                return "error_event"
            if line == "data: [DONE]":
                return "ok"
            num_events += line.startswith("data: ")
            if abort_after is not None and num_events >= abort_after:
                return "aborted"
    return "incomplete_stream"


async def client_loop(url: str, seed: int, is_going, args, outcomes: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.deadline)) as client:
        while is_going():
            try:
                outcome = await asyncio.wait_for(
                    one_request(client, rng, args.abort_rate), args.deadline
                )
            except asyncio.TimeoutError:
                outcome = "hang"
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            outcomes[outcome] += 1


def rss_mib(server: Child) -> float:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {server.pid}")


def is_in_rotation(proxy_url: str, worker_url: str) -> bool:
    workers = httpx.get(f"{proxy_url}/ready", timeout=5).json()["workers"]
    return any(w["url"] == worker_url and w["healthy"] for w in workers)


def rolling_restarts(bench: Bench, cluster: Cluster, times: int, seconds: float) -> list[dict]:
    """`times` restarts of the decode workers in turn, evenly spaced over `seconds`: SIGTERM
    (they run with --drain-migrate), wait for the exit, start the same command again, wait
    until it is healthy and the proxy has it in rotation again. Runs beside the load, on the
    main thread; one record per restart."""
    records: list[dict] = []
    decode = cluster.workers["decode"]
    gap = seconds / (times + 1)
    started = time.monotonic()
    for k in range(times):
        time.sleep(max(0.0, started + gap * (k + 1) - time.monotonic()))
        i = k % len(decode)
        old = decode[i]
        t0 = time.monotonic()
        old.send(signal.SIGTERM)
        code = old.popen.wait(60)
        exit_s = time.monotonic() - t0
        new = bench.sup.start(old.name, list(old.popen.args), url=old.url, log_path=old.log_path)
        bench.sup.children.remove(old)
        decode[i] = new
        bench.wait_ok(f"{new.url}/health", timeout=120)
        # and back in the proxy's rotation before the next goes: else the next one's streams
        # would find no other D to move to
        wait_until(lambda url=new.url: is_in_rotation(cluster.proxy.url, url), timeout=60)
        records.append({"worker": old.name, "exit_code": code, "exit_s": round(exit_s, 2),
                        "back_s": round(time.monotonic() - t0, 1)})  # fmt: skip
    return records


async def run_load(
    url: str, args, seconds: float, outcomes: Counter, hold: threading.Event | None = None
) -> None:
    """`args.clients` client loops for `seconds`, and on until `hold` is set when given."""
    until = time.monotonic() + seconds

    def is_going() -> bool:
        return time.monotonic() < until or (hold is not None and not hold.is_set())

    clients = (client_loop(url, i, is_going, args, outcomes) for i in range(args.clients))
    await asyncio.gather(*clients)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of measured load")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before RSS start")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--abort-rate", type=float, default=0.1)
    ap.add_argument("--deadline", type=float, default=180.0, help="a request past this is a hang")
    ap.add_argument("--model", help="HF folder (default: the built-in SmolLM2)")
    ap.add_argument("--json", type=Path, help="also write the ledger here")
    ap.add_argument(
        "--rolling-restarts", type=int, default=0,
        help="restart the decode workers in turn this many times during the load (SIGTERM with"
        " --drain-migrate, then start again)",
    )  # fmt: skip
    args = ap.parse_args()
    decode_args = ("--drain-migrate",) if args.rolling_restarts else ()
    with Bench("soak") as bench:  # SIGTERM (e.g. from `timeout`) stops every child too
        model_args = ["--model", args.model] if args.model else []
        cluster = start_cluster(bench, model_args, decode_args)
        proxy, workers = cluster.proxy, cluster.children[1:]
        logs = bench.log_dir
        warm: Counter = Counter()
        asyncio.run(run_load(proxy.url, args, args.warmup, warm))
        rss_start = [rss_mib(w) for w in workers]
        outcomes: Counter = Counter()
        # the load on a thread, the restarts here: a child dies with the thread that started
        # it (PR_SET_PDEATHSIG), so restarted workers must be started by this one; the load
        # goes on until the last restarted worker is back
        restarted = threading.Event()
        load = threading.Thread(
            target=asyncio.run,
            args=(run_load(proxy.url, args, args.duration, outcomes, restarted),),
        )
        started = time.monotonic()
        load.start()
        restarts = rolling_restarts(bench, cluster, args.rolling_restarts, args.duration)
        restarted.set()
        load.join()
        elapsed = time.monotonic() - started
        workers = cluster.children[1:]  # the restarted decode workers are new processes
        for w in workers:  # leases (20 s) and reservations expire by then at the latest
            wait_until(lambda w=w: metric(w.url, "pdserve_kv_blocks_used") == 0, timeout=60)
        leaked = [int(metric(w.url, "pdserve_kv_blocks_used")) for w in workers]
        rss_end = [rss_mib(w) for w in workers]
        moved = migrations(proxy.url)
    ledger = {
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "abort_rate": args.abort_rate,
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "warmup_requests": sum(warm.values()),
        "leaked_blocks": dict(zip(["P0", "P1", "D0", "D1"], leaked)),
        "rss_mib": {
            n: [round(a, 1), round(b, 1)]
            for n, a, b in zip(["P0", "P1", "D0", "D1"], rss_start, rss_end)
        },  # fmt: skip
        "restarts": restarts,
        "migrations": moved,
        "logs": str(logs),
    }
    report(ledger)
    if args.json:
        args.json.write_text(json.dumps(ledger, indent=2))
    restarted = {r["worker"].replace("decode-", "D") for r in restarts}
    growth = max(
        [(b - a) / a for n, (a, b) in ledger["rss_mib"].items() if n not in restarted] or [0.0]
    )
    errors = sum(v for k, v in outcomes.items() if k not in ("ok", "aborted"))
    is_restart_bad = bool(restarts) and (
        errors > 0 or any(r["exit_code"] != 0 for r in restarts)
        or len(restarts) < args.rolling_restarts
    )  # fmt: skip
    sys.exit(int(sum(leaked) > 0 or outcomes["hang"] > 0 or growth >= 0.05 or is_restart_bad))


def migrations(url: str) -> dict[str, int]:
    """The proxy's `pdserve_proxy_migrations_total` by reason (moved streams and calls)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r'^pdserve_proxy_migrations_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: int(float(value)) for reason, value in found if float(value)}


def report(ledger: dict) -> None:
    outcomes = ledger["outcomes"]
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "aborted")}
    print(f"\n### Soak: {ledger['duration_s']:.0f} s, {ledger['clients']} streams, "
          f"{ledger['abort_rate']:.0%} aborts, proxy + 2 P + 2 D\n")  # fmt: skip
    print("| requests | ok | aborted by client | errors | hangs | leaked blocks |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {ledger['requests']} | {outcomes.get('ok', 0)} | {outcomes.get('aborted', 0)} "
          f"| {sum(errors.values()) - outcomes.get('hang', 0)} {errors or ''} "
          f"| {outcomes.get('hang', 0)} | {sum(ledger['leaked_blocks'].values())} |")  # fmt: skip
    print("\n| worker | RSS after warm-up (MiB) | RSS at end (MiB) | growth |")
    print("|---|---:|---:|---:|")
    for name, (start, end) in ledger["rss_mib"].items():
        print(f"| {name} | {start:.1f} | {end:.1f} | {(end - start) / start:+.1%} |")
    if ledger["restarts"]:
        print("\n| restarted | exit status | seconds to exit | seconds until healthy again |")
        print("|---|---:|---:|---:|")
        for r in ledger["restarts"]:
            print(f"| {r['worker']} | {r['exit_code']} | {r['exit_s']} | {r['back_s']} |")
        print(f"\nmigrations by reason: {ledger['migrations']}")


if __name__ == "__main__":
    main()
