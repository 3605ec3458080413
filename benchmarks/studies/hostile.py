"""Hostile requests against the README's cluster: does one request hurt the others?

Starts the local launcher's cluster with two decode workers (1 P + 2 D + the proxy, the default
model, the cores split as `deploy.local` splits them) and, in each of `--rounds` rounds, streams
a victim chat (`--victim-tokens` tokens, greedy, EOS ignored) alone and then beside each attack,
in turn:

    n_10m            a streamed completion with n = 10,000,000
    choice_20k       guided_choice of 20,000 strings
    regex_100k       a guided regex of 100,000 characters
    nested_regex_n4  the regex ((a{70}){70}){70} with n = 4 (cost per step, not size)
    deep_arguments   a chat whose history holds tool-call arguments 1,500 deep
    deep_tools       tool parameters ~975 deep with tool_choice required
    fields_100k      20 bodies of 100,000 unknown fields each, one after another
    header_1mb       a request with a 1 MiB header

Each attack starts once the victim has streamed 8 tokens. Reported per attack, medians over the
rounds: the attack's status and seconds to its answer, the proxy's slowest /health while it ran
(polled every 50 ms), the victim's longest gap between two tokens and that gap over the victim's
own alone in the same round, and whether every process of the cluster is still alive. The
issue's goal: a 400 (or a bounded run) within 1 s, every process alive, and the victim's longest
gap within 2x its gap alone.

    .venv/bin/python -m benchmarks.studies.hostile [--rounds 3] [--json docs/results/FILE.json]

Loopback only; every request is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.cluster import Bench, LocalConfig
from benchmarks.peers.protocol import machine_header

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def _deep_tools_body() -> bytes:
    schema = '{"type":"object","properties":{"a":' * 487 + '{"type":"object"}' + "}}" * 487
    return (
        b'{"messages":%s,"max_tokens":8,"tool_choice":"required","tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":%s}}]}' % (json.dumps(HI).encode(), schema.encode())
    )


def _deep_arguments_body() -> bytes:
    arguments = '{"a":' * 1500 + "1" + "}" * 1500
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [*HI, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
    return json.dumps({"messages": messages, "max_tokens": 8}).encode()


def _attacks() -> dict[str, list[tuple[str, bytes, dict]]]:
    """name: the requests it sends one after another, (path, body, headers)."""
    dumps = lambda body: json.dumps(body).encode()  # noqa: E731
    fields = {f"x{i}": 1 for i in range(100_000)}
    return {
        "n_10m": [(COMPLETIONS, dumps({"prompt": "hi", "n": 10**7, "stream": True}), {})],
        "choice_20k": [(COMPLETIONS, dumps({"prompt": "hi", "max_tokens": 8,
                        "guided_choice": [f"option {i}" for i in range(20_000)]}), {})],
        "regex_100k": [(COMPLETIONS, dumps({"prompt": "hi", "max_tokens": 8,
                        "guided_regex": "(ab|cd)" * 14_286}), {})],
        "nested_regex_n4": [(COMPLETIONS, dumps({"prompt": "hi", "max_tokens": 64, "n": 4,
                             "guided_regex": "((a{70}){70}){70}", "stream": True}), {})],
        "deep_arguments": [(CHAT, _deep_arguments_body(), {})],
        "deep_tools": [(CHAT, _deep_tools_body(), {})],
        "fields_100k": [(COMPLETIONS, dumps({"prompt": "hi", "max_tokens": 1, **fields}), {})]
        * 20,
        "header_1mb": [(COMPLETIONS, dumps({"prompt": "hi", "max_tokens": 1}),
                        {"X-Big": "a" * (1 << 20)})],
    }  # fmt: skip


def victim(url: str, num_tokens: int, started: threading.Event) -> float:
    """The longest gap between two tokens of one streamed chat, seconds; `started` is set once
    8 tokens have come."""
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
    body = {"messages": messages, "max_tokens": num_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times: list[float] = []
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())
                if len(times) == 8:
                    started.set()
    started.set()
    assert len(times) >= num_tokens // 2, f"the victim got {len(times)} tokens"
    return max(b - a for a, b in zip(times, times[1:]))


def attack(url: str, requests: list[tuple[str, bytes, dict]]) -> tuple[list[int], float]:
    """The statuses and the seconds until the last answer ended."""
    start, statuses = time.perf_counter(), []
    for path, body, headers in requests:
        headers = {"content-type": "application/json", **headers}
        try:
            with httpx.stream("POST", f"{url}{path}", content=body, headers=headers,
                              timeout=120) as r:  # fmt: skip
                for _ in r.iter_bytes():
                    pass
                statuses.append(r.status_code)
        except httpx.HTTPError as e:
            statuses.append(-1)
            print(f"  attack request failed: {e!r}")
    return statuses, time.perf_counter() - start


def slowest_health(url: str, stop: threading.Event) -> float:
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            client.get(f"{url}/health")
            worst = max(worst, time.perf_counter() - t)
            stop.wait(0.05)
    return worst


def one_run(url: str, num_tokens: int, requests) -> dict:
    """The victim alone (`requests` None) or beside one attack."""
    started, done, out = threading.Event(), threading.Event(), {}

    def run_victim():
        out["gap"] = victim(url, num_tokens, started)
        done.set()

    thread = threading.Thread(target=run_victim)
    thread.start()
    if requests is not None:
        started.wait(120)
        health_stop = threading.Event()
        poll = lambda: out.update(health=slowest_health(url, health_stop))  # noqa: E731
        health = threading.Thread(target=poll)
        health.start()
        out["statuses"], out["seconds"] = attack(url, requests)
        health_stop.set()
        health.join()
    thread.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--victim-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="attacks to run (default: all)")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    a = ap.parse_args()
    attacks = _attacks()
    names = a.only or list(attacks)
    with Bench("hostile") as bench:
        cluster = bench.cluster(LocalConfig(num_decode=2, port=0))
        bench.wait_ready(cluster)
        url = cluster.proxy.url
        one_run(url, 16, None)  # warm-up: compiled graphs, the first stream
        runs: dict[str, list[dict]] = {"alone": [], **{name: [] for name in names}}
        for r in range(a.rounds):
            runs["alone"].append(one_run(url, a.victim_tokens, None))
            for name in names:
                run = one_run(url, a.victim_tokens, attacks[name])
                run["ratio"] = run["gap"] / runs["alone"][-1]["gap"]
                run["alive"] = all(c.is_running for c in bench.sup.children)
                runs[name].append(run)
                print(f"round {r + 1} {name}: {run}", flush=True)
    print(machine_header())
    alone = statistics.median(run["gap"] for run in runs["alone"])
    print(f"victim alone: longest gap {alone * 1e3:.0f} ms (median of {a.rounds})\n")
    print(
        "| attack | status | answered in s | proxy /health max s | victim gap ms | gap / alone "
        "| all alive |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for name in names:
        rs = runs[name]
        med = lambda key, rs=rs: statistics.median(run[key] for run in rs)  # noqa: E731
        statuses = sorted({s for run in rs for s in run["statuses"]})
        alive = all(run["alive"] for run in rs)
        print(f"| {name} | {statuses} | {med('seconds'):.2f} | {med('health'):.3f} "
              f"| {med('gap') * 1e3:.0f} | {med('ratio'):.2f} | {alive} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"machine": machine_header(), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
