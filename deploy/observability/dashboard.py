"""The pdserve Grafana dashboard, generated from the panels below (grafanalib), never hand-edited.

    python -m deploy.observability.dashboard > deploy/observability/grafana/pdserve.json
    python -m deploy.observability.dashboard --out deploy/observability/grafana/pdserve.json
    python -m deploy.observability.dashboard --write-all   # every committed copy (COPIES)

`ROWS` is the whole dashboard as data: rows of panels, each a title, a unit, what it shows and
its PromQL queries over the `pdserve_*` metrics every process exports on /metrics
(common/api/metrics.py for the workers, proxy/metrics.py for the proxy). tests/test_observability.py
regenerates the JSON and evaluates every query against a real Prometheus scraping a real cluster;
deploy/observability/preview.py plots them. docs/observability.md says what each panel reads.

Every query is a `sum by (...)` over the variables' selection (`$job`, `$instance`), so it reads
the same with one proxy process or several (the proxy's /metrics merges its siblings) and with one
worker or many per pool. Scrape jobs are the pools: pdserve-prefill, pdserve-decode, pdserve-proxy
(compose, deploy.local and the Kubernetes ServiceMonitors all name them so).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, TimeSeries

ROOT = Path(__file__).resolve().parents[2]
# the committed copies: compose's Grafana mounts the first; the Kubernetes overlay's ConfigMap is
# made from the second (kustomize reads no file outside the overlay's folder)
COPIES = (
    ROOT / "deploy" / "observability" / "grafana" / "pdserve.json",
    ROOT / "deploy" / "kubernetes" / "overlays" / "monitoring" / "pdserve.json",
)
UID = "pdserve"
JOB_REGEX = "^pdserve"  # the scrape jobs $job offers: compose's, deploy.local's, the Services'
SELECTION = 'job=~"$job",instance=~"$instance"'
WINDOW = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
DATASOURCE = "${datasource}"
PANEL_WIDTH, PANEL_HEIGHT = 12, 8  # two panels a line (Grafana's grid is 24 wide)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana's unit id: s, reqps, GBs, short, percentunit
    description: str
    queries: tuple[Query, ...]


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def selector(match: str = "") -> str:
    """`{job=~"$job",instance=~"$instance"[,match]}`."""
    return "{" + ",".join(m for m in (SELECTION, match) if m) + "}"


def rate(metric: str, by: str = "", match: str = "") -> str:
    """Per second over the panel's window, summed over the selected processes."""
    return f"sum by ({by}) (rate({metric}{selector(match)}[{WINDOW}]))"


def quantiles(histogram: str, by: str = "", legend: str = "", match: str = "") -> tuple:
    """p50, p90 and p99 of a histogram (its `_bucket` series), merged over the selection."""
    keys = ", ".join(k for k in ("le", by) if k)
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({keys}) "
            f"(rate({histogram}_bucket{selector(match)}[{WINDOW}])))",
            f"{legend}p{round(q * 100)}".strip(),
        )
        for q in QUANTILES
    )


def everything(expr: str, window: str) -> str:
    """A panel's query as Grafana sends it with every pool and process selected and
    `$__rate_interval` standing for `window` (tests and deploy/observability/preview.py)."""
    for variable, value in (("$job", ".*"), ("$instance", ".*"), (WINDOW, window)):
        expr = expr.replace(variable, value)
    return expr


def gauge(metric: str, by: str, legend: str, match: str = "") -> Query:
    return Query(f"sum by ({by}) ({metric}{selector(match)})", legend)


TRAFFIC = Row(
    "Traffic",
    (
        Panel(
            "Requests by route and status",
            "reqps",
            "Answered requests a second: the proxy's (pdserve_proxy_requests_total) and each"
            " worker pool's own (pdserve_requests_total), by route and HTTP status.",
            (
                Query(
                    rate("pdserve_proxy_requests_total", "endpoint, status"),
                    "proxy {{endpoint}} {{status}}",
                ),
                Query(
                    rate("pdserve_requests_total", "job, endpoint, status"),
                    "{{job}} {{endpoint}} {{status}}",
                ),
            ),
        ),
        Panel(
            "Errors",
            "reqps",
            "Answers that were not 2xx, by route and status, at the proxy and at the workers;"
            " the proxy's failed calls to workers by kind (connect, timeout, http_N); streams"
            " ended by an error event.",
            (
                Query(
                    rate("pdserve_proxy_requests_total", "endpoint, status", 'status!~"2.."'),
                    "proxy {{endpoint}} {{status}}",
                ),
                Query(
                    rate("pdserve_requests_total", "job, endpoint, status", 'status!~"2.."'),
                    "{{job}} {{endpoint}} {{status}}",
                ),
                Query(
                    rate("pdserve_proxy_upstream_errors_total", "role, kind"),
                    "upstream {{role}} {{kind}}",
                ),
                Query(rate("pdserve_proxy_stream_errors_total"), "stream error events"),
            ),
        ),
    ),
)

TTFT = Row(
    "Where the time to first token went",
    (
        Panel(
            "TTFT at the proxy",
            "s",
            "Arrival at the proxy to the first byte sent to the client"
            " (pdserve_proxy_time_to_first_byte_seconds). A streamed one-choice request gets P's"
            " first token at once (the default): about 1 + 2, and 4 delays its second token;"
            " otherwise (--no-first-token-from-prefill, n > 1) the proxy waits for D: 1 + 2 + 4.",
            quantiles("pdserve_proxy_time_to_first_byte_seconds"),
        ),
        Panel(
            "1. Queue at the proxy",
            "s",
            "Admission: arrival in the proxy's queue to a slot (pdserve_proxy_queue_wait_seconds;"
            " only with --max-concurrency).",
            quantiles("pdserve_proxy_queue_wait_seconds"),
        ),
        Panel(
            "2. Prefill on P",
            "s",
            "The proxy's prefill call to P, from sending it to P's answer"
            " (pdserve_proxy_prefill_seconds; disaggregated requests only). In push mode it"
            " includes the KV WRITEs that did not overlap P's forward.",
            quantiles("pdserve_proxy_prefill_seconds"),
        ),
        Panel(
            "3. KV transfer per request",
            "s",
            "One request's KV transfer (pdserve_kv_transfer_request_seconds): op=read is a pull"
            " on D (its first READ to its load done), op=write a push from P (its first WRITE to"
            " its last one landing).",
            quantiles("pdserve_kv_transfer_request_seconds", "op", "{{op}} "),
        ),
        Panel(
            "4. First step on the worker",
            "s",
            "The engine's part: the request handed to the engine to its first output token there"
            " (pdserve_first_step_seconds). On D after a remote prefill this is its first decode"
            " step, with the wait for pushed KV, or the pull it overlaps; on a colocated D it is"
            " the whole prefill.",
            quantiles("pdserve_first_step_seconds", "job", "{{job}} "),
        ),
        Panel(
            "TTFT at the workers",
            "s",
            "Each pool's own time to first token, from the request's arrival at the worker"
            " (pdserve_time_to_first_token_seconds): on D, after P's prefill.",
            quantiles("pdserve_time_to_first_token_seconds", "job", "{{job}} "),
        ),
    ),
)

DECODE = Row(
    "Decode",
    (
        Panel(
            "Inter-token latency (ITL)",
            "s",
            "Time between two streamed outputs of a request on the worker"
            " (pdserve_inter_token_latency_seconds).",
            quantiles("pdserve_inter_token_latency_seconds", "job", "{{job}} "),
        ),
        Panel(
            "Time per output token (TPOT)",
            "s",
            "A finished request's time after its first token over its other tokens"
            " (pdserve_time_per_output_token_seconds).",
            quantiles("pdserve_time_per_output_token_seconds", "job", "{{job}} "),
        ),
        Panel(
            "Tokens a second",
            "short",
            "Prompt and generated tokens of finished requests, a second, by pool"
            " (pdserve_prompt_tokens_total, pdserve_generation_tokens_total).",
            (
                Query(rate("pdserve_prompt_tokens_total", "job"), "{{job}} prompt"),
                Query(rate("pdserve_generation_tokens_total", "job"), "{{job}} generated"),
            ),
        ),
        Panel(
            "Running and waiting on the workers",
            "short",
            "Requests in each worker's running batch and waiting to be scheduled"
            " (pdserve_num_requests_running, pdserve_num_requests_waiting).",
            (
                gauge("pdserve_num_requests_running", "job, instance", "{{instance}} running"),
                gauge("pdserve_num_requests_waiting", "job, instance", "{{instance}} waiting"),
            ),
        ),
    ),
)

KV_TRANSFER = Row(
    "KV transfer",
    (
        Panel(
            "KV transfer GB/s",
            "GBs",
            "Bytes moved a second over the window: pulled by D (pdserve_kv_transfer_bytes_total)"
            " and pushed by P (pdserve_kv_push_bytes_total); and the rate while transferring"
            " (bytes over pdserve_kv_transfer_seconds_total or pdserve_kv_push_seconds_total).",
            (
                Query(rate("pdserve_kv_transfer_bytes_total", "job") + " / 1e9", "{{job}} pull"),
                Query(rate("pdserve_kv_push_bytes_total", "job") + " / 1e9", "{{job}} push"),
                Query(
                    rate("pdserve_kv_transfer_bytes_total", "job")
                    + " / "
                    + rate("pdserve_kv_transfer_seconds_total", "job")
                    + " / 1e9",
                    "{{job}} pull, while reading",
                ),
                Query(
                    rate("pdserve_kv_push_bytes_total", "job")
                    + " / "
                    + rate("pdserve_kv_push_seconds_total", "job")
                    + " / 1e9",
                    "{{job}} push, while writing",
                ),
            ),
        ),
        Panel(
            "NIXL descriptors a layer",
            "short",
            "Descriptors a layer per request's transfer (pdserve_kv_descriptors; 2: its blocks"
            " are one run on both sides, K and V), and descriptors posted a second by D's pulls"
            " (pdserve_kv_transfer_descriptors_total).",
            (
                *quantiles("pdserve_kv_descriptors", "op", "{{op}} ")[::2],
                Query(rate("pdserve_kv_transfer_descriptors_total", "job"), "{{job}} pull /s"),
            ),
        ),
        Panel(
            "KV transfer failures",
            "short",
            "A second: failed pulls (pdserve_kv_transfer_failures_total), failed pushes"
            " (pdserve_kv_push_failures_total), checksum mismatches"
            " (pdserve_kv_checksum_failures_total) and held blocks freed by an expired lease"
            " (pdserve_kv_lease_expiries_total).",
            tuple(
                Query(rate(f"pdserve_{name}_total", "job"), f"{{{{job}}}} {name}")
                for name in (
                    "kv_transfer_failures",
                    "kv_push_failures",
                    "kv_checksum_failures",
                    "kv_lease_expiries",
                )
            ),
        ),
    ),
)

KV_CACHE = Row(
    "KV cache",
    (
        Panel(
            "KV blocks",
            "short",
            "Each worker's blocks: used by requests, free (empty or evictable), held for remote"
            " readers (P), in a transfer, quarantined until transfers into them settle"
            " (pdserve_kv_blocks_{used,free,held,in_transfer,quarantined}).",
            tuple(
                gauge(f"pdserve_kv_blocks_{kind}", "job, instance", f"{{{{instance}}}} {kind}")
                for kind in ("used", "free", "held", "in_transfer", "quarantined")
            ),
        ),
        Panel(
            "Prefix-cache hit rate",
            "percentunit",
            "Each worker's prefix-cache hits over queries since it started"
            " (pdserve_prefix_cache_hit_rate), and over the window the share of prompt tokens"
            " P reported cached (pdserve_proxy_prefill_cached_tokens_total over"
            " pdserve_proxy_prefill_prompt_tokens_total).",
            (
                gauge("pdserve_prefix_cache_hit_rate", "job, instance", "{{job}} {{instance}}"),
                Query(
                    rate("pdserve_proxy_prefill_cached_tokens_total")
                    + " / "
                    + rate("pdserve_proxy_prefill_prompt_tokens_total"),
                    "P's cached prompt tokens (as the proxy saw them)",
                ),
            ),
        ),
    ),
)

ROUTING = Row(
    "Routing and recovery",
    (
        Panel(
            "Routed path mix",
            "reqps",
            "Requests a second by path (disaggregated, colocated) and why"
            " (pdserve_proxy_routed_total): reason cached_on_decode is a prompt D already held.",
            (Query(rate("pdserve_proxy_routed_total", "path, reason"), "{{path}} ({{reason}})"),),
        ),
        Panel(
            "Retries, ejections, recomputes, migrations",
            "short",
            "A second: calls retried on another worker (pdserve_proxy_retries_total), workers"
            " ejected (pdserve_proxy_worker_ejections_total), remote prefills D recomputed"
            " instead of loading their KV, by reason (pdserve_kv_recomputed_total), and decode"
            " streams moved to another worker (pdserve_proxy_migrations_total).",
            (
                Query(rate("pdserve_proxy_retries_total", "role"), "retries {{role}}"),
                Query(rate("pdserve_proxy_worker_ejections_total", "role"), "ejections {{role}}"),
                Query(rate("pdserve_kv_recomputed_total", "reason"), "recomputed {{reason}}"),
                Query(rate("pdserve_proxy_migrations_total", "reason"), "migrated {{reason}}"),
            ),
        ),
        Panel(
            "Multi-turn reuse",
            "short",
            "A second: prefills offered the prompt prefix the decode worker holds, by outcome"
            " (pdserve_proxy_reverse_pulls_total), prompt tokens P read from D instead of"
            " computing them (pdserve_proxy_reverse_pull_tokens_total), and requests routed by"
            " their X-Session-ID, by pool and outcome (pdserve_proxy_session_routed_total).",
            (
                Query(rate("pdserve_proxy_reverse_pulls_total", "outcome"), "lend {{outcome}}"),
                Query(rate("pdserve_proxy_reverse_pull_tokens_total"), "tokens read from D"),
                Query(
                    rate("pdserve_proxy_session_routed_total", "role, outcome"),
                    "session {{role}} {{outcome}}",
                ),
            ),
        ),
    ),
)

ADMISSION = Row(
    "Admission",
    (
        Panel(
            "Proxy queue",
            "short",
            "Requests waiting for a slot (pdserve_proxy_queue_depth) and holding one"
            " (pdserve_proxy_admitted_running), over every proxy process; in flight to each"
            " pool (pdserve_proxy_outstanding).",
            (
                gauge("pdserve_proxy_queue_depth", "", "queued"),
                gauge("pdserve_proxy_admitted_running", "", "holding a slot"),
                gauge("pdserve_proxy_outstanding", "role", "in flight to {{role}}"),
            ),
        ),
        Panel(
            "429s by reason",
            "reqps",
            "Requests refused with 429 a second, by reason: rate_limited, queue_full,"
            " queue_timeout (pdserve_proxy_admission_rejected_total).",
            (Query(rate("pdserve_proxy_admission_rejected_total", "reason"), "{{reason}}"),),
        ),
    ),
)

WORKERS = Row(
    "Workers",
    (
        Panel(
            "Scrape health",
            "short",
            "1 while Prometheus scrapes the process (up), by pool and instance.",
            (gauge("up", "job, instance", "{{job}} {{instance}}"),),
        ),
        Panel(
            "Workers as the proxy sees them",
            "short",
            "1 while the proxy routes to the worker (pdserve_proxy_worker_healthy; the largest"
            " over proxy processes), and the pools' workers by state (pdserve_proxy_workers).",
            (
                Query(
                    f"max by (role, url) (pdserve_proxy_worker_healthy{selector()})",
                    "{{role}} {{url}}",
                ),
                Query(
                    f"max by (role, state) (pdserve_proxy_workers{selector()})",
                    "{{role}} {{state}}",
                ),
            ),
        ),
    ),
)

ROWS = (TRAFFIC, TTFT, DECODE, KV_TRANSFER, KV_CACHE, ROUTING, ADMISSION, WORKERS)


def variables() -> Templating:
    common = dict(
        dataSource=DATASOURCE, includeAll=True, multi=True, allValue=".*", default="$__all"
    )
    return Templating(
        [
            Template(name="datasource", label="Prometheus", query="prometheus", type="datasource"),
            Template(
                name="job",
                label="pool",
                query="label_values(up, job)",
                regex=f"/{JOB_REGEX}/",
                **common,
            ),
            Template(
                name="instance",
                label="process",
                query='label_values(up{job=~"$job"}, instance)',
                **common,
            ),
        ]
    )


def time_series(panel: Panel, x: int, y: int) -> TimeSeries:
    return TimeSeries(
        title=panel.title,
        description=panel.description,
        dataSource=DATASOURCE,
        unit=panel.unit,
        gridPos=GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=x, y=y),
        targets=[
            Target(expr=q.expr, legendFormat=q.legend, refId=chr(ord("A") + i))
            for i, q in enumerate(panel.queries)
        ],
    )


def dashboard() -> Dashboard:
    panels, y = [], 0
    for row in ROWS:
        panels.append(RowPanel(title=row.title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, panel in enumerate(row.panels):
            x = (i % 2) * PANEL_WIDTH
            panels.append(time_series(panel, x, y))
            y += PANEL_HEIGHT if i % 2 or i == len(row.panels) - 1 else 0
    return Dashboard(
        title="pdserve",
        uid=UID,
        description="Disaggregated prefill/decode serving: traffic, where TTFT went, decode,"
        " KV transfer and cache, routing, admission, workers (docs/observability.md)",
        tags=["pdserve"],
        timezone="browser",
        refresh="10s",
        schemaVersion=36,
        panels=panels,
        templating=variables(),
    ).auto_panel_ids()


def render() -> str:
    data = dashboard().to_json_data()
    return json.dumps(data, cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.observability.dashboard")
    p.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    p.add_argument("--write-all", action="store_true", help="write every committed copy")
    a = p.parse_args(argv)
    text = render()
    for path in COPIES if a.write_all else [a.out] if a.out else []:
        path.write_text(text)
    if not a.write_all and a.out is None:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
