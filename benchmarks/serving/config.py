"""The benchmark's settings: one frozen dataclass, validated on creation (the CLI builds it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmarks.serving.client import ENDPOINT_TYPES
from benchmarks.serving.conversations import ConversationConfig
from benchmarks.serving.datasets import DatasetConfig
from benchmarks.serving.metrics import LATENCY_METRICS, SLO_METRICS
from benchmarks.serving.runner import LoadConfig


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "completions"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_timeout: float = 600.0
    num_prompts: int = 100
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    conversations: ConversationConfig | None = None  # a multi-turn run (then no `dataset`)
    load: LoadConfig = field(default_factory=LoadConfig)
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    slos_ms: dict[str, float] = field(default_factory=dict)  # --goodput
    result_file: str | None = None
    plot_dir: str | None = None
    label: str | None = None  # vLLM's --label (default: the endpoint type)
    metadata: dict[str, str] = field(default_factory=dict)  # vLLM's --metadata KEY=VALUE
    save_detailed: bool = False  # vLLM's per-request lists in the result

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://: {self.base_url}")
        if self.endpoint_type not in ENDPOINT_TYPES:
            raise ValueError(f"--endpoint-type must be one of {list(ENDPOINT_TYPES)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        unknown = set(self.percentile_metrics) - set(LATENCY_METRICS)
        if unknown:
            raise ValueError(
                f"--percentile-metrics: unknown {sorted(unknown)}; "
                f"choose from {list(LATENCY_METRICS)}"
            )
        if not all(0 <= p <= 100 for p in self.percentiles):
            raise ValueError(f"--metric-percentiles must be in [0, 100]: {self.percentiles}")
        if self.conversations is not None:
            if self.endpoint_type != "chat":
                raise ValueError("a multi-turn dataset needs --endpoint-type chat")
            load = self.load
            if load.request_rate != math.inf or load.num_warmups or load.duration:
                raise ValueError(
                    "a multi-turn run paces itself (--max-concurrency, --multiturn-think-time):"
                    " no --request-rate, --num-warmups or --duration"
                )
        for name, limit in self.slos_ms.items():
            if name not in SLO_METRICS or limit < 0:
                raise ValueError(f"--goodput: bad SLO {name}:{limit}")

    @property
    def root_url(self) -> str:
        """The server's root, whether the URL was given with a trailing /v1 or not."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
