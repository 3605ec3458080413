"""A multi-turn run's own metrics, over `Turn`s: latencies by turn index, and prompt caching.

    by_turn        TTFT, TPOT and ITL (ms) of the completed requests of each turn index 1..T,
                   and of turns 2+ pooled ("2+": the turns that have a history to reuse)
    cache shares   of the prompt tokens, those served from a prefix cache:
                   prefill   the proxy's `pdserve_proxy_prefill_cached_tokens_total` over
                             `..._prefill_prompt_tokens_total`, as deltas over the run (P's own
                             word, relayed by the proxy; None without a proxy in front)
                   lent      the proxy's `pdserve_proxy_reverse_pull_tokens_total` over the same
                             prompt tokens: what P read from D instead of computing (the reverse
                             pull; None without a proxy)
                   served    the streamed answers' `usage.prompt_tokens_details.cached_tokens` over
                             their `prompt_tokens`: what the worker that answered (D in P/D, the
                             lone worker otherwise) took from its cache (None if no usage said)
    routed         the proxy's `pdserve_proxy_routed_total` deltas, "path/reason" → requests: how
                   many turns went through P at all (a prompt D already holds goes to D alone)

The aggregate metrics (throughput, goodput, pooled latencies) are benchmarks/serving/metrics.py's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from benchmarks.serving.client import RequestRecord
from benchmarks.serving.metrics import LatencyStats, latency_stats, latency_values, percentile_name

TURN_METRICS = ("ttft", "tpot", "itl")
PREFILL_CACHED = "pdserve_proxy_prefill_cached_tokens_total"
PREFILL_PROMPT = "pdserve_proxy_prefill_prompt_tokens_total"
PREFILL_LENT = "pdserve_proxy_reverse_pull_tokens_total"
ROUTED = re.compile(r'pdserve_proxy_routed_total\{path="([^"]*)",reason="([^"]*)"\}')


@dataclass
class Turn:
    """One request of a conversation: which, what it sent, and how it went."""

    conversation: int  # 0-based
    turn: int  # 1-based
    messages: list[dict]
    record: RequestRecord

    def to_dict(self) -> dict:
        return {
            "conversation": self.conversation,
            "turn": self.turn,
            **asdict(self.record),
            "messages": self.messages,
        }


@dataclass(frozen=True)
class CacheShares:
    prefill_cached_tokens: float | None
    prefill_prompt_tokens: float | None
    served_cached_tokens: int | None
    served_prompt_tokens: int
    prefill_lent_tokens: float | None = None

    @property
    def lent_share(self) -> float | None:
        if not self.prefill_prompt_tokens or self.prefill_lent_tokens is None:
            return None
        return self.prefill_lent_tokens / self.prefill_prompt_tokens

    @property
    def prefill_share(self) -> float | None:
        if not self.prefill_prompt_tokens or self.prefill_cached_tokens is None:
            return None
        return self.prefill_cached_tokens / self.prefill_prompt_tokens

    @property
    def served_share(self) -> float | None:
        if self.served_cached_tokens is None or not self.served_prompt_tokens:
            return None
        return self.served_cached_tokens / self.served_prompt_tokens

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "prefill_share": self.prefill_share,
            "lent_share": self.lent_share,
            "served_share": self.served_share,
        }


def turn_groups(turns: list[Turn]) -> dict[str, list[RequestRecord]]:
    """{"1": ..., "2": ..., "2+": ...}: each turn index's records, and turns 2+ pooled."""
    groups: dict[str, list[RequestRecord]] = {}
    for t in sorted(turns, key=lambda t: t.turn):
        groups.setdefault(str(t.turn), []).append(t.record)
    groups["2+"] = [t.record for t in turns if t.turn >= 2]
    return groups


def by_turn(turns: list[Turn], percentiles: list[float]) -> dict[str, dict]:
    """{group: {"completed": n, "ttft": LatencyStats, ...}} (ms)."""
    out = {}
    for name, records in turn_groups(turns).items():
        values = latency_values(records)
        stats = {m: latency_stats(values[m], percentiles) for m in TURN_METRICS}
        out[name] = {"completed": sum(r.success for r in records), **stats}
    return out


def cache_shares(turns: list[Turn], server_delta: dict[str, float] | None) -> CacheShares:
    ok = [t.record for t in turns if t.record.success]
    told = [r for r in ok if r.cached_tokens is not None]
    delta = server_delta or {}
    return CacheShares(
        prefill_cached_tokens=delta.get(PREFILL_CACHED),
        prefill_prompt_tokens=delta.get(PREFILL_PROMPT),
        served_cached_tokens=sum(r.cached_tokens for r in told) if told else None,
        served_prompt_tokens=sum(r.prompt_len for r in told),
        prefill_lent_tokens=delta.get(PREFILL_LENT),
    )


def routed(server_delta: dict[str, float] | None) -> dict[str, int]:
    """{"disaggregated/pull": n, "colocated/cached_on_decode": n, ...}, the nonzero ones."""
    out = {}
    for key, value in (server_delta or {}).items():
        match = ROUTED.fullmatch(key)
        if match and value:
            out["/".join(match.groups())] = int(value)
    return out


def by_turn_dict(groups: dict[str, dict]) -> dict[str, dict]:
    """JSON-ready: vLLM-style keys per group (median_ttft_ms, p99_itl_ms, ...)."""
    out = {}
    for name, group in groups.items():
        row = {"completed": group["completed"]}
        for metric in TURN_METRICS:
            row.update(_flat(metric, group[metric]))
        out[name] = row
    return out


def _flat(metric: str, stats: LatencyStats) -> dict[str, float | None]:
    row = {f"mean_{metric}_ms": stats.mean, f"median_{metric}_ms": stats.median}
    for p, value in stats.percentiles.items():
        row[f"p{percentile_name(p)}_{metric}_ms"] = value
    return row


def format_turn_table(groups: dict[str, dict], shares: CacheShares, paths: dict[str, int]) -> str:
    def ms(value: float | None) -> str:
        return f"{value:9.1f}" if value is not None else f"{'-':>9}"

    head = ("TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99")
    lines = [" Multi-turn: latency by turn (ms) ".center(72, "=")]
    lines.append(f"{'turn':<5}{'done':>5} " + "".join(f"{h:>10}" for h in head))
    for name, g in groups.items():
        t, tp, itl = g["ttft"].percentiles, g["tpot"].percentiles, g["itl"].percentiles
        cells = (t.get(50.0), t.get(90.0), t.get(99.0), tp.get(50.0), itl.get(50.0), itl.get(99.0))
        lines.append(f"{name:<5}{g['completed']:>5} " + "".join(f" {ms(c)}" for c in cells))
    lines.append(" Prompt tokens served from cache ".center(72, "-"))
    lines.append(f"{'on P (proxy counters):':<40} {_share(shares.prefill_share)}")
    lines.append(f"{'read by P from D (the reverse pull):':<40} {_share(shares.lent_share)}")
    lines.append(f"{'by the answering worker (usage):':<40} {_share(shares.served_share)}")
    for path, num in sorted(paths.items()):
        lines.append(f"{'routed ' + path + ':':<40} {num}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"
