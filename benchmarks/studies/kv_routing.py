"""KV-aware prefill routing vs round robin on a shared-prefix workload, in the same run.

Two prefill workers and one decode worker (the built-in SmolLM2-135M-Instruct unless --model,
fp32, one torch thread each, not pinned: the three share this box's cores), each publishing its
KV events (deploy/cluster.py's cluster, benchmarks/cluster.py), and four proxies in front of the
same three workers:

    round_robin   --prefill-policy round_robin --no-kv-routing: no events, no render
    kv_aware      --prefill-policy prefix: by the blocks each P holds, per its KV events
                  (token ids rendered by a worker; proxy/kv_routing.py)
    kv_aware_x1   the same in one process (--workers 1; the others run 2): what a
                  per-process index and per-process load counts cost
    hash_prefix   --prefill-policy prefix --no-kv-routing: the hash fallback (consistent
                  hashing of the prompt's start, bounded by each process's own load counts)

Both run with `--cached-on-decode-tokens 0`, so that every request is prefilled on a P: what is
compared is the choice of P alone. Workload: `--groups` groups of `--per-group` text completions;
a group's prompts share a prefix of `--prefix-words` random words, then each has its own
question; all are shuffled and sent `--concurrency` at a time, streamed, `--output-len` tokens
each. P's KV cache (`--prefill-blocks`) holds some of the groups' prefixes, not all: routing that
keeps each group on one P needs half the room that spreading every group over both does.

Each (round, policy) phase has its own prefixes (its own seed): nothing one phase cached helps
another; the order of the policies alternates by round. Prefix-hit rate: the prompt tokens P
served from its own prefix cache, as P's answers report them (`usage.prompt_tokens_details`,
summed by the proxy: `pdserve_proxy_prefill_cached_tokens_total`), over the ideal: every request
but the first of its group finds the full blocks it shares with that first one cached.

    .venv/bin/python -m benchmarks.studies.kv_routing [--groups 8] [--per-group 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from benchmarks.cluster import ROOT, Bench, LocalConfig
from benchmarks.serving.benchmark import benchmark
from benchmarks.serving.config import BenchConfig
from benchmarks.serving.datasets import SampleRequest
from benchmarks.serving.runner import LoadConfig

POLICIES = {  # each proxy runs 2 processes (--workers 2) but kv_aware_x1, which runs one
    "round_robin": ["--prefill-policy", "round_robin", "--no-kv-routing", "--workers", "2"],
    "kv_aware": ["--prefill-policy", "prefix", "--workers", "2"],
    "kv_aware_x1": ["--prefill-policy", "prefix", "--workers", "1"],
    "hash_prefix": ["--prefill-policy", "prefix", "--no-kv-routing", "--workers", "2"],
}
KV_AWARE = ("kv_aware", "kv_aware_x1")
SYLLABLES = (
    "ka", "lo", "mi", "ren", "tas", "vor", "quin", "del", "sa", "pe",
    "mar", "on", "tul", "bri", "zen", "ax", "os", "lu", "fi", "dar",
)  # fmt: skip


@dataclass(frozen=True)
class Study:
    groups: int = 8
    per_group: int = 5
    prefix_words: int = 220  # ~500 tokens of SmolLM2's tokenizer
    question_words: int = 16
    output_len: int = 8
    concurrency: int = 2
    rounds: int = 2
    prefill_blocks: int = 192  # per P: ~5 of the 8 prefixes, with room for requests in flight
    block_size: int = 16
    seed: int = 0
    model: str | None = None
    json_path: Path = ROOT / "docs" / "results" / "kv_routing.json"

    def __post_init__(self):
        if min(self.groups, self.per_group, self.concurrency, self.rounds) < 1:
            raise ValueError("--groups, --per-group, --concurrency and --rounds must be >= 1")


def start_cluster(bench: Bench, study: Study) -> tuple[dict[str, str], str]:
    """P1, P2, D and one proxy per policy; the proxies' URLs, and D's (it renders)."""
    cfg = LocalConfig(
        num_prefill=2,
        model=study.model,
        is_cpu_split=False,  # one thread each, not pinned: the three share the box
        worker_args=("--cpu-threads", "1", "--block-size", str(study.block_size),
                     "--max-model-len", "2048", "--log-level", "warning"),
        prefill_args=("--num-blocks", str(study.prefill_blocks)),
    )  # fmt: skip
    first, *others = POLICIES
    common = ["--cached-on-decode-tokens", "0", "--log-level", "warning"]
    cluster = bench.cluster(replace(cfg, proxy_args=(*common, *POLICIES[first])))
    proxies = {first: cluster.proxy.url}
    for policy in others:
        proxies[policy] = bench.proxy(
            f"proxy_{policy}", cluster, cfg, [*common, *POLICIES[policy]]
        ).url
    bench.wait_ready(cluster)
    for proxy in proxies.values():
        bench.wait_ok(f"{proxy}/ready")
    indexed = 'pdserve_proxy_kv_index_blocks{role="prefill"'
    deadline = time.monotonic() + 30
    for policy in KV_AWARE:
        while scrape_text(proxies[policy]).count(indexed) < 2:  # subscribed to both P
            if time.monotonic() > deadline:
                sys.exit(f"the {policy} proxy did not subscribe to both prefill workers' events")
            time.sleep(0.2)
    return proxies, cluster.urls("decode")[0]


def words(rng: random.Random, num: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(num))


def workload(study: Study, seed: int, render_url: str) -> tuple[list[SampleRequest], int]:
    """The phase's shuffled requests, and the ideal number of prefix-cached prompt tokens."""
    rng = random.Random(seed)
    prefixes = [
        f"Shared context {g}: {words(rng, study.prefix_words)}." for g in range(study.groups)
    ]
    asks = [
        (g, f"{prefixes[g]}\nQuestion {i}: {words(rng, study.question_words)}?")
        for g in range(study.groups)
        for i in range(study.per_group)
    ]
    rng.shuffle(asks)
    first: dict[int, list[int]] = {}
    samples, ideal = [], 0
    for group, prompt in asks:
        ids = render(render_url, prompt)
        if group in first:
            ideal += shared_blocks(first[group], ids, study.block_size) * study.block_size
        else:
            first[group] = ids
        samples.append(SampleRequest(prompt, len(ids), study.output_len))
    return samples, ideal


def render(url: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions/render", json={"prompt": prompt}, timeout=30)
    r.raise_for_status()
    return r.json()[0]["token_ids"]


def shared_blocks(a: list[int], b: list[int], size: int) -> int:
    """Leading full blocks two prompts have in common."""
    num = 0
    for start in range(0, min(len(a), len(b)) - size + 1, size):
        if a[start : start + size] != b[start : start + size]:
            break
        num += 1
    return num


def scrape_text(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in scrape_text(url).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def run_phase(study: Study, policy: str, url: str, samples, ideal: int) -> dict:
    before = scrape(url)
    cfg = BenchConfig(
        base_url=url,
        num_prompts=len(samples),
        load=LoadConfig(max_concurrency=study.concurrency, show_progress=False),
    )
    result = asyncio.run(benchmark(cfg, samples, {}))
    after = scrape(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    renders = delta("pdserve_proxy_render_seconds_count")
    return {
        "policy": policy,
        "completed": result["completed"],
        "failed": result["failed"],
        "cached_tokens": delta("pdserve_proxy_prefill_cached_tokens_total"),
        "prompt_tokens": delta("pdserve_proxy_prefill_prompt_tokens_total"),
        "ideal_cached_tokens": ideal,
        "hit_of_ideal": delta("pdserve_proxy_prefill_cached_tokens_total") / ideal,
        "median_ttft_ms": result["median_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "request_throughput": result["request_throughput"],
        "render_mean_ms": 1000 * delta("pdserve_proxy_render_seconds_sum") / renders
        if renders
        else None,
        "ttfts_ms": [1000 * r["ttft"] for r in result["requests"] if r["ttft"] is not None],
    }


def study_run(study: Study, proxies: dict[str, str], render_url: str, bench: Bench) -> list[dict]:
    phases = []
    for r in range(study.rounds):
        order = list(POLICIES) if r % 2 == 0 else list(POLICIES)[::-1]
        for i, policy in enumerate(order):
            bench.check_alive()
            seed = study.seed + 100 * r + i
            samples, ideal = workload(study, seed, render_url)
            load = os.getloadavg()[0]
            print(f"\n#### round {r}: {policy} (load average {load:.2f})", flush=True)
            phase = run_phase(study, policy, proxies[policy], samples, ideal)
            phases.append({"round": r, "seed": seed, "load_avg_1m_before": load, **phase})
    return phases


def report(study: Study, phases: list[dict], started: float) -> None:
    lines = [
        "| round | policy | done/failed | prefix hits / ideal | TTFT p50 ms | TTFT p99 ms | req/s "
        "| render ms (mean) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        render_ms = "-" if p["render_mean_ms"] is None else f"{p['render_mean_ms']:.1f}"
        lines.append(
            f"| {p['round']} | {p['policy']} | {p['completed']}/{p['failed']} "
            f"| {100 * p['hit_of_ideal']:.0f}% | {p['median_ttft_ms']:.0f} "
            f"| {p['p99_ttft_ms']:.0f} | {p['request_throughput']:.2f} | {render_ms} |"
        )
    pooled = {}
    for policy in POLICIES:
        mine = [p for p in phases if p["policy"] == policy]
        ttfts = sorted(t for p in mine for t in p["ttfts_ms"])
        pooled[policy] = {
            "hit_of_ideal": sum(p["cached_tokens"] for p in mine)
            / sum(p["ideal_cached_tokens"] for p in mine),
            "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "req_s": statistics.mean(p["request_throughput"] for p in mine),
        }
    rr, kv = pooled["round_robin"], pooled["kv_aware"]
    lines += [
        "",
        "| policy (all rounds) | prefix hits / ideal | TTFT p50 ms | TTFT p99 ms | req/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy, p in pooled.items():
        lines.append(
            f"| {policy} | {100 * p['hit_of_ideal']:.0f}% | {p['ttft_p50_ms']:.0f} "
            f"| {p['ttft_p99_ms']:.0f} | {p['req_s']:.2f} |"
        )
    ratio = rr["ttft_p50_ms"] / kv["ttft_p50_ms"]
    lines.append(f"\nTTFT p50 round_robin / kv_aware: {ratio:.2f}x")
    print("\n" + "\n".join(lines))
    result = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "study": asdict(study),
        "wall_s": time.monotonic() - started,
        "load_avg_end": os.getloadavg(),
        "pooled": pooled,
        "ttft_p50_ratio": ratio,
        "phases": phases,
    }
    study.json_path.parent.mkdir(parents=True, exist_ok=True)
    study.json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"Wrote {study.json_path}; wall time {result['wall_s']:.0f} s")


def parse_args() -> Study:
    d = Study()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name in ("groups", "per_group", "prefix_words", "question_words", "output_len",
                 "concurrency", "rounds", "prefill_blocks", "block_size", "seed"):  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--model", help="HF folder (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--json", type=Path, default=d.json_path)
    a = vars(ap.parse_args())
    try:
        return Study(**{k: v for k, v in a.items() if k != "json"}, json_path=a["json"])
    except ValueError as e:
        ap.error(str(e))


def main() -> None:
    study = parse_args()
    started = time.monotonic()
    with Bench("kv_routing") as bench:
        proxies, render_url = start_cluster(bench, study)
        phases = study_run(study, proxies, render_url, bench)
    report(study, phases, started)


if __name__ == "__main__":
    main()
