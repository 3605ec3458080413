"""What a run leaves: vLLM's "Serving Benchmark Result" table, the result JSON, and `compare`.

The result JSON holds every aggregate metric (flat, vLLM's key names), `failures` by reason,
`requests` (one record per request sent, times in seconds), `args` (the command line; the API
key redacted, inf written "inf"), `model`, `endpoint_type`, `date` and `server_metrics`
({before, after, delta} of the server's /metrics samples, or null when it has none).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.serving.config import BenchConfig
from benchmarks.serving.metrics import BenchmarkMetrics, percentile_name
from benchmarks.serving.prometheus import server_metrics
from benchmarks.serving.runner import RunResult

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _line(label: str, value) -> str:
    if value is None:
        return f"{label:<40} {'-':<10}"
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def format_table(
    m: BenchmarkMetrics,
    percentile_metrics: list[str],
    percentiles: list[float],
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
) -> str:
    lines = [" Serving Benchmark Result ".center(50, "=")]
    lines.append(_line("Successful requests:", m.completed))
    lines.append(_line("Failed requests:", m.failed))
    lines += [_line(f"  {reason}:", n) for reason, n in sorted(m.failures.items())]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _line("Benchmark duration (s):", m.duration),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput))
    lines += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
        _line("Peak concurrent requests:", m.max_concurrent_requests),
        _line("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    for name in percentile_metrics:
        short, title = HEADERS[name]
        stats = m.latency[name]
        lines.append(title.center(50, "-"))
        lines.append(_line(f"Mean {short} (ms):", stats.mean))
        lines.append(_line(f"Median {short} (ms):", stats.median))
        for p in percentiles:
            label = f"P{percentile_name(p)} {short} (ms):"
            lines.append(_line(label, stats.percentiles.get(float(p))))
    lines.append("=" * 50)
    return "\n".join(lines)


def build_result(
    metrics: BenchmarkMetrics, run: RunResult, args: dict, model: str, cfg: BenchConfig
) -> dict:
    """The result JSON: vLLM's keys (`vllm bench serve --save-result`, so that scripts and
    dashboards reading those carry over), then ours: `model`, `failures`, `args`, `requests`
    (every record) and `server_metrics`. `--metadata` keys go on top, as vLLM puts them."""
    redacted = {k: ("***" if k == "api_key" and v else _finite(v)) for k, v in args.items()}
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": cfg.endpoint_type,
        "label": cfg.label or cfg.endpoint_type,
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": cfg.num_prompts,
        "request_rate": _finite(cfg.load.request_rate),
        "burstiness": cfg.load.burstiness,
        "max_concurrency": cfg.load.max_concurrency,
        **metrics.to_dict(),
        "model": model,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "args": redacted,
        "requests": [asdict(r) for r in run.records],
        "server_metrics": server_metrics(run.server_before, run.server_after),
    }
    if cfg.save_detailed:  # vLLM's per-request lists; seconds, as vLLM writes them
        records = run.records
        result["input_lens"] = [r.prompt_len for r in records]
        result["output_lens"] = [r.output_len for r in records]
        result["ttfts"] = [r.ttft or 0.0 for r in records]
        result["itls"] = [list(r.itl) for r in records]
        result["errors"] = [r.error for r in records]
    return {**result, **cfg.metadata}


def _finite(value):
    """inf as "inf": strict JSON has no Infinity (vLLM writes a request rate of inf so too)."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def write_result(path: str | Path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _scalars(result: dict) -> dict[str, float]:
    return {
        k: v
        for k, v in result.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "date"
    }


def format_compare(a: dict, b: dict, name_a: str = "a", name_b: str = "b") -> str:
    """Every numeric aggregate of two result files side by side, with the ratio b/a."""
    sa, sb = _scalars(a), _scalars(b)
    keys = list(sa) + [k for k in sb if k not in sa]
    width = max(len(k) for k in keys) if keys else 10
    rows = [f"{'metric':<{width}}  {name_a[:14]:>14}  {name_b[:14]:>14}  {'b/a':>8}"]
    for key in keys:
        va, vb = sa.get(key), sb.get(key)
        ratio = f"{vb / va:8.3f}" if va and vb is not None else f"{'-':>8}"
        rows.append(f"{key:<{width}}  {_num(va):>14}  {_num(vb):>14}  {ratio}")
    return "\n".join(rows)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def load_result(path: str | Path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a result file {path}: {e}") from e
    if not isinstance(result, dict):
        raise ValueError(f"{path} is not a result file (a JSON object)")
    return result
