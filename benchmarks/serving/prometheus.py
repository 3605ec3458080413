"""The server's Prometheus `/metrics`, scraped before and after a run.

Samples are keyed `name{label="value",...}` (labels sorted). The delta covers the cumulative
samples only — counters, and histograms' and summaries' buckets, counts and sums — never gauges
or `_created` timestamps; NaN and infinite samples are left out. A server without `/metrics`
(or with an unreadable one) gives None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

CUMULATIVE_TYPES = ("counter", "histogram", "summary")


@dataclass(frozen=True)
class Scrape:
    values: dict[str, float]  # {sample key: value}
    cumulative: frozenset[str]  # the keys of cumulative samples


def parse(text: str) -> Scrape:
    values: dict[str, float] = {}
    cumulative: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isfinite(sample.value):
                continue
            key = sample_key(sample.name, sample.labels)
            values[key] = float(sample.value)
            if family.type in CUMULATIVE_TYPES and not sample.name.endswith("_created"):
                cumulative.add(key)
    return Scrape(values, frozenset(cumulative))


def sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict) -> Scrape | None:
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
        if r.status_code != 200:
            return None
        return parse(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def delta(before: Scrape, after: Scrape) -> dict[str, float]:
    """after − before for every cumulative sample of `after` (a new one counts from 0)."""
    old = before.values
    return {key: after.values[key] - old.get(key, 0.0) for key in sorted(after.cumulative)}


def server_metrics(before: Scrape | None, after: Scrape | None) -> dict | None:
    if before is None or after is None:
        return None
    return {"before": before.values, "after": after.values, "delta": delta(before, after)}
