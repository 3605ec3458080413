"""The worker's HTTP server settings (`ServerConfig`), which `common.api.cli` parses from the
command line; the engine's settings are `common.config.EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.api.limits import RequestLimits
from common.api.tools import PARSERS
from common.cpu import CpuBudget
from common.credentials import check_secret
from common.tracing import check_traces_endpoint

TOKEN_HEADER = "X-Internal-Token"  # carries internal_token between a cluster's workers


@dataclass(frozen=True)
class ServerConfig:
    role: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model folder's name
    max_waiting: int = 1024
    arrival_wait: float = 0.01  # seconds an idle engine waits for requests being parsed
    max_body_bytes: int = 4 << 20
    drain_timeout: float = 30.0
    drain_migrate: bool = False  # SIGTERM ends in-flight generations at once, for the proxy
    internal_token: str | None = None  # required by the internal routes when set
    tool_call_parser: str | None = None  # tools/parsers.py's PARSERS; None: from the template
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector of traces; None: no tracing
    log_level: str = "info"
    cpu: CpuBudget = field(default_factory=CpuBudget)  # applied at startup (common/cpu.py)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0 <= self.arrival_wait <= 60:
            raise ValueError(
                f"--arrival-wait-ms must be in [0, 60000], got {self.arrival_wait * 1e3:g}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        check_secret("internal_token", self.internal_token)
        check_traces_endpoint(self.otlp_traces_endpoint)
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            names = ", ".join(sorted(PARSERS))
            raise ValueError(f"--tool-call-parser must be one of {names}")

    @property
    def internal_headers(self) -> dict[str, str]:
        """What this worker sends to its peers' internal routes."""
        return {TOKEN_HEADER: self.internal_token} if self.internal_token else {}
