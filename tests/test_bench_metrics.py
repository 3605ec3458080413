"""The serving benchmark's metric definitions on a synthetic timeline (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.serving import prometheus
from benchmarks.serving.client import RequestRecord
from benchmarks.serving.datasets import DatasetConfig, length_bounds, load_samples
from benchmarks.serving.metrics import compute_metrics, meets_slos, tpot
from benchmarks.serving.runner import arrival_times


def ok(start, ttft, itl, e2el, output_len, prompt_len=10) -> RequestRecord:
    return RequestRecord(
        success=True,
        ttft=ttft,
        itl=list(itl),
        e2el=e2el,
        prompt_len=prompt_len,
        output_len=output_len,
        start_time=start,
    )


def failed(reason: str) -> RequestRecord:
    return RequestRecord(success=False, error_reason=reason, prompt_len=99, output_len=0)


# r1: 4 tokens, TPOT (0.2 - 0.1) / 3; r2: 2 tokens, TPOT 0.15; r3: one token, no TPOT
R1 = ok(0.00, 0.10, [0.02, 0.03, 0.05], 0.20, 4)
R2 = ok(0.05, 0.30, [0.10], 0.45, 2, prompt_len=20)
R3 = ok(0.10, 0.05, [], 0.06, 1, prompt_len=30)
RECORDS = [R1, failed("timeout"), R2, failed("http_500"), R3, failed("timeout")]


def test_tpot_excludes_the_first_token():
    assert tpot(R1) == pytest.approx((0.20 - 0.10) / 3)
    assert tpot(R2) == pytest.approx(0.15)
    assert tpot(R3) is None  # output_len <= 1: no TPOT


def test_counts_and_throughput():
    m = compute_metrics(RECORDS, duration=2.0, percentiles=[50])
    assert (m.completed, m.failed) == (3, 3)
    assert m.failures == {"timeout": 2, "http_500": 1}
    assert m.total_input_tokens == 60  # failed requests' prompts are not counted
    assert m.total_output_tokens == 7
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput is None  # no SLOs given
    assert m.max_concurrent_requests == 3  # all three overlap at t = 0.1
    assert m.max_output_tokens_per_s == 7  # every chunk lands in the first second


def test_latency_stats_over_completed_requests_only():
    m = compute_metrics(RECORDS, duration=1.0, percentiles=[50, 99.9])
    ttft, tpot_, itl, e2el = (m.latency[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert ttft.mean == pytest.approx(150.0)
    assert ttft.median == pytest.approx(100.0)
    assert ttft.percentiles[90.0] == pytest.approx(260.0)  # linear between 100 and 300
    assert ttft.std == pytest.approx(np.std([100, 300, 50]))
    assert tpot_.mean == pytest.approx((100 / 3 + 150) / 2)
    assert itl.mean == pytest.approx(50.0)  # every gap pooled: 20, 30, 50, 100
    assert itl.median == pytest.approx(40.0)
    assert e2el.percentiles[50.0] == pytest.approx(200.0)
    flat = m.to_dict()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in flat  # p90 and p99 always, p50 / p99.9 asked for


def test_goodput_needs_every_slo():
    assert meets_slos(R3, {"tpot": 0.0})  # one token: TPOT counts as 0
    cases = [
        ({"ttft": 150}, 2),  # r1, r3
        ({"tpot": 50}, 2),  # r1 (33 ms), r3 (0)
        ({"ttft": 150, "e2el": 100}, 1),  # r3 only
        ({"ttft": 150, "tpot": 20}, 1),  # r1 misses TPOT
        ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),  # failed requests never count
    ]
    for slos, num_good in cases:
        m = compute_metrics(RECORDS, duration=2.0, percentiles=[], slos_ms=slos)
        assert m.request_goodput == pytest.approx(num_good / 2.0), slos


def test_all_failed_has_no_latencies():
    m = compute_metrics([failed("connection_error")] * 2, duration=1.0, percentiles=[50])
    assert (m.completed, m.failed, m.failures) == (0, 2, {"connection_error": 2})
    assert m.latency["ttft"].mean is None and m.to_dict()["p99_e2el_ms"] is None
    assert m.total_output_tokens == 0 and m.max_concurrent_requests == 0


def test_arrivals():
    assert arrival_times(4, float("inf"), 1.0, seed=0) == [0.0] * 4
    times = arrival_times(200, rate=10.0, burstiness=1.0, seed=0)
    assert times == sorted(times) and times[-1] == pytest.approx(20.0)  # num / rate
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.25)  # exponential: CV 1
    even = np.diff(arrival_times(50, rate=10.0, burstiness=float("inf"), seed=0))
    assert even == pytest.approx(np.full(49, 0.1))


def test_random_dataset_lengths():
    assert length_bounds(100, 0.5) == (50, 150)
    assert length_bounds(1, 0.9) == (1, 2)
    cfg = DatasetConfig(random_input_len=20, random_output_len=5, random_prefix_len=4)
    samples = load_samples(cfg, 5, is_chat=False, seed=1)
    assert all(s.prompt_len == 24 and len(s.prompt) == 24 for s in samples)
    assert len({tuple(s.prompt[:4]) for s in samples}) == 1  # the shared prefix
    assert all(100 <= t < 1000 for s in samples for t in s.prompt)
    assert samples == load_samples(cfg, 5, is_chat=False, seed=1)  # seeded
    chat = load_samples(cfg, 2, is_chat=True, seed=1)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 24 for s in chat)


def test_prometheus_counter_deltas():
    text = """# HELP req_total Requests
# TYPE req_total counter
req_total{status="200",endpoint="/v1/completions"} {n}
req_created{status="200",endpoint="/v1/completions"} 1.7e9
# TYPE lat histogram
lat_bucket{le="+Inf"} {n}
lat_count {n}
lat_sum 0.5
# TYPE running gauge
running 3
"""
    before = prometheus.parse(text.replace("{n}", "2"))
    after = prometheus.parse(text.replace("{n}", "5"))
    d = prometheus.delta(before, after)
    assert d['req_total{endpoint="/v1/completions",status="200"}'] == 3
    assert d["lat_count"] == 3 and d["lat_sum"] == 0
    assert "running" not in d and not any("created" in k for k in d)
    assert after.values["running"] == 3
