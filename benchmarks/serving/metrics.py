"""The aggregate metrics of `vllm bench serve`: pure functions over `RequestRecord`s.

Failed requests are counted (`failed`, and by reason in `failures`) and appear in nothing else.
Over the completed ones:

    total_input_tokens / total_output_tokens   sums of prompt_len / output_len
    request_throughput       completed / duration
    output_throughput        total_output_tokens / duration
    total_token_throughput   (total_input_tokens + total_output_tokens) / duration
    request_goodput          requests meeting every --goodput SLO / duration (None without SLOs);
                             a request with output_len <= 1 has TPOT 0 here
    ttft_ms, e2el_ms         one value per request
    tpot_ms                  (e2el − ttft) / (output_len − 1), requests with output_len > 1
    itl_ms                   every gap of every request, pooled
    max_output_tokens_per_s  token chunks received in the busiest whole second
    max_concurrent_requests  the most requests in flight at once

Each latency gets mean, median, std (population) and percentiles (numpy's linear
interpolation), in ms; p90 and p99 are always computed. An empty set of values gives None.
`duration` is the benchmark's wall time, from its start until the last request ended.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.serving.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
ALWAYS_PERCENTILES = (90.0, 99.0)


@dataclass(frozen=True)
class LatencyStats:
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[float, float | None]


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    failures: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]  # by LATENCY_METRICS name, in ms

    def to_dict(self) -> dict:
        """Flat, with vLLM's key names: mean_ttft_ms, p99_itl_ms, ..."""
        out = {k: v for k, v in asdict(self).items() if k != "latency"}
        for name, stats in self.latency.items():
            out[f"mean_{name}_ms"] = stats.mean
            out[f"median_{name}_ms"] = stats.median
            out[f"std_{name}_ms"] = stats.std
            for p, value in stats.percentiles.items():
                out[f"p{percentile_name(p)}_{name}_ms"] = value
        return out


def percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, in s; None for one token or fewer."""
    if record.output_len <= 1:
        return None
    return (record.e2el - record.ttft) / (record.output_len - 1)


def latency_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, over completed requests: one value per request, or every gap for itl."""
    ok = [r for r in records if r.success]
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def latency_stats(values_s: list[float], percentiles: list[float]) -> LatencyStats:
    if not values_s:
        return LatencyStats(None, None, None, {p: None for p in percentiles})
    ms = np.asarray(values_s) * 1000.0
    return LatencyStats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={p: float(np.percentile(ms, p)) for p in percentiles},
    )


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput test: every given SLO met (TPOT counts as 0 for output_len <= 1)."""
    measured = {"ttft": record.ttft, "tpot": tpot(record) or 0.0, "e2el": record.e2el}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def output_tokens_per_second(records: list[RequestRecord]) -> list[int]:
    """Token chunks received in each whole second since the first request started."""
    ok = [r for r in records if r.success]
    if not ok:
        return []
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.e2el for r in ok)
    buckets = [0] * (math.ceil(end - t0) + 1)
    for r in ok:
        at = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            at += gap
            buckets[int(at - t0)] += 1
    return buckets


def peak_concurrency(records: list[RequestRecord]) -> int:
    """The most completed requests in flight at once ([start, end) intervals)."""
    events = []
    for r in records:
        if r.success:
            events += [(r.start_time, 1), (r.start_time + r.e2el, -1)]
    peak = current = 0
    for _, step in sorted(events):  # at a tie, an end (-1) sorts before a start
        current += step
        peak = max(peak, current)
    return peak


def compute_metrics(
    records: list[RequestRecord],
    duration: float,
    percentiles: list[float],
    slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    assert duration > 0, f"duration must be positive, got {duration}"
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in ok) / duration
    wanted = sorted(set(map(float, percentiles)) | set(ALWAYS_PERCENTILES))
    values = latency_values(records)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        failures=dict(Counter(r.error_reason for r in records if not r.success)),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration=duration,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=float(max(output_tokens_per_second(records), default=0)),
        max_concurrent_requests=peak_concurrency(records),
        latency={name: latency_stats(values[name], wanted) for name in LATENCY_METRICS},
    )
