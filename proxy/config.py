"""The proxy's configuration: one frozen dataclass, from the command line or a config file.

`--config FILE` (JSON, or TOML on Python 3.11+) holds the same keys as the flags, with dashes
or underscores (`{"prefill": ["http://p1:8100"], "decode": [...], "port": 8000}`); flags given
on the command line win over the file. A pool entry is a worker's URL or `dns://NAME:PORT`, the
workers at PORT on every address NAME resolves to (proxy/discovery.py).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from common.api.limits import LIMIT_NAMES, RequestLimits, add_limit_flags, limits_from
from common.credentials import check_secret, pick_secret
from common.tracing import check_traces_endpoint
from proxy.admission import RateLimit, parse_key_priorities, parse_rate_limits
from proxy.discovery import (
    MAX_WORKERS,
    DiscoveryLimits,
    DnsName,
    is_dns_entry,
    parse_dns_server,
)

MODES = ("pull", "push", "colocated")
POLICIES = ("round_robin", "least_outstanding", "power_of_two", "prefix")
HTTP_CLIENTS = ("lean", "httpx")
SECRETS = {  # setting: the environment variable it is read from when no flag or file gives it
    "api_key": "PDSERVE_API_KEY",
    "admin_key": "PDSERVE_ADMIN_KEY",
    "internal_token": "PDSERVE_INTERNAL_TOKEN",
}
SECRET_FLAGS = frozenset(f"--{n.replace('_', '-')}{end}" for n in SECRETS for end in ("", "-file"))


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 2.0  # seconds between active checks of one worker
    timeout: float = 1.0
    failure_threshold: int = 2  # consecutive failed checks that eject a worker
    success_threshold: int = 1  # consecutive good checks that readmit it

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0:
            raise ValueError("health interval and timeout must be > 0")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "pull"
    first_token_from_prefill: bool = True  # stream P's token at once; D continues after it
    min_disagg_tokens: int = 0  # shorter prompts (estimated) go to D alone
    prefill_policy: str = "prefix"
    decode_policy: str = "least_outstanding"
    prefix_chars: int = 256  # leading characters of the prompt that key prefix-aware routing
    api_key: str | None = None
    admin_key: str | None = None  # admin routes; defaults to api_key
    internal_token: str | None = None  # sent to the workers' internal routes
    max_body_bytes: int = 4 << 20
    connect_timeout: float = 2.0
    prefill_timeout: float = 300.0  # one prefill, end to end
    decode_timeout: float = 60.0  # the longest silence of a decode stream
    request_timeout: float = 600.0  # the longest wait for a non-streamed decode answer
    max_retries: int = 2  # more prefill workers tried after the first fails
    migration_limit: int = 3  # times one request may move to another D when its D fails; 0: off
    health: HealthConfig = field(default_factory=HealthConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)  # checked before the workers
    discovery_interval: float = 5.0  # seconds between resolutions of a dns:// entry
    dns_server: str | None = None  # IP[:PORT] asked instead of the system's resolver
    discovery_max_workers: int = MAX_WORKERS  # workers one dns:// entry may bring; the lowest
    discovery_allow: tuple[str, ...] = ()  # CIDRs a discovered address must be in; () any
    rate_limit: tuple[str, ...] = ()  # KEY=RPS[:BURST]; the key `default`: every key not listed
    key_priority: tuple[str, ...] = ()  # KEY=high|normal|low: its default and ceiling; `default`
    max_concurrency: int = 0  # requests in flight through the proxy; 0: no limit, no queue
    max_queue: int = 1024  # requests waiting for a slot beyond that
    queue_timeout: float = 30.0  # the longest wait for a slot, seconds
    drain_timeout: float = 10.0  # on SIGTERM: seconds in-flight requests get before they close
    # KV-aware routing (proxy/kv_routing.py): subscribe to the workers' KV events, route by them
    kv_routing: bool = True
    cached_on_decode_tokens: int = 64  # a D holding all of a prompt but fewer: D alone; 0: off
    reverse_pull_min_tokens: int = 32  # P reads a prefix D holds when it saves as many; 0: off
    # session affinity (proxy/sessions.py): an X-Session-ID's requests stay on its workers
    session_affinity: bool = True
    max_sessions: int = 100_000  # sessions remembered per pool; the least recent are forgotten
    workers: int = 0  # proxy processes on the port (proxy/processes.py); 0: one per core
    http_client: str = "lean"  # to the workers: proxy/transport.py, or httpx's own ("httpx")
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector of traces; None: no tracing
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode entry (a URL or dns://NAME:PORT) is needed")
        for role in ("prefill", "decode"):
            entries = getattr(self, role)
            if len(set(entries)) != len(entries):
                raise ValueError(f"a {role} entry is given twice: {list(entries)}")
            for entry in entries:
                if is_dns_entry(entry):
                    DnsName.parse(entry)
                elif not entry.startswith(("http://", "https://")):
                    raise ValueError(
                        f"worker URL must start with http://, https:// or dns://: {entry!r}"
                    )
        if self.discovery_interval <= 0:
            raise ValueError(f"discovery_interval must be > 0, got {self.discovery_interval}")
        if self.dns_server is not None:
            parse_dns_server(self.dns_server)
        DiscoveryLimits(self.discovery_max_workers, self.discovery_allow)  # raises if bad
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        if self.decode_policy == "prefix":
            raise ValueError("prefix-aware routing is for prefill workers only")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.min_disagg_tokens < 0 or self.max_retries < 0 or self.prefix_chars < 1:
            raise ValueError("min_disagg_tokens and max_retries must be >= 0, prefix_chars >= 1")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        timeouts = (self.connect_timeout, self.prefill_timeout, self.decode_timeout)
        if min(*timeouts, self.request_timeout) <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: one per core), got {self.workers}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.http_client not in HTTP_CLIENTS:
            raise ValueError(f"http_client must be one of {HTTP_CLIENTS}, got {self.http_client!r}")
        self._check_admission()
        for name in SECRETS:
            check_secret(name, getattr(self, name))
        check_traces_endpoint(self.otlp_traces_endpoint)
        for name in ("cached_on_decode_tokens", "reverse_pull_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def _check_admission(self) -> None:
        parse_rate_limits(self.rate_limit)
        parse_key_priorities(self.key_priority)
        if self.max_concurrency < 0 or self.max_queue < 0:
            raise ValueError("max_concurrency and max_queue must be >= 0")
        if self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {self.queue_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")

    @property
    def rate_limits(self) -> dict[str, RateLimit]:
        return parse_rate_limits(self.rate_limit)

    @property
    def key_priorities(self) -> dict[str, int]:
        return parse_key_priorities(self.key_priority)

    @property
    def effective_admin_key(self) -> str | None:
        return self.admin_key or self.api_key

    @property
    def dns_server_address(self) -> tuple[str, int] | None:
        return parse_dns_server(self.dns_server) if self.dns_server else None

    def static_urls(self, role: str) -> list[str]:
        return [e for e in getattr(self, role) if not is_dns_entry(e)]

    @property
    def discovery_limits(self) -> DiscoveryLimits:
        return DiscoveryLimits(self.discovery_max_workers, self.discovery_allow)

    def dns_names(self, role: str) -> list[DnsName]:
        limits = self.discovery_limits
        return [DnsName.parse(e, limits) for e in getattr(self, role) if is_dns_entry(e)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proxy",
        description="The OpenAI front door: routes each request through one prefill and one "
        "decode worker (or a decode worker alone).",
    )
    add = p.add_argument
    add("--config", type=Path, help="JSON or TOML file with any of these settings")
    add(
        "--prefill",
        action="append",
        help="a prefill worker's URL, or dns://NAME:PORT for every address of NAME (repeat)",
    )
    add("--decode", action="append", help="a decode worker's URL, or dns://NAME:PORT (repeat)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="port (default 8000)")
    add("--mode", choices=MODES, help="pull (default; vLLM-compatible), push, or colocated")
    add(
        "--no-first-token-from-prefill",
        dest="first_token_from_prefill",
        action="store_const",
        const=False,
        help="wait for D's stream instead of sending P's first token to the client at once",
    )
    add(
        "--min-disagg-tokens",
        type=int,
        help="prompts shorter than this (estimated tokens) skip prefill workers (default 0)",
    )
    add("--prefill-policy", choices=POLICIES, help="routing over prefill workers (prefix)")
    add("--decode-policy", choices=POLICIES[:3], help="routing over decode workers")
    add("--prefix-chars", type=int, help="prompt characters that key prefix routing (256)")
    add(
        "--api-key",
        help="clients must send 'Authorization: Bearer KEY'; a flag is readable by every user of "
        "the host: prefer --api-key-file or env PDSERVE_API_KEY",
    )
    add("--api-key-file", metavar="PATH", help="read --api-key from this file")
    add(
        "--admin-key",
        help="key of the /admin routes (default: --api-key); or --admin-key-file, env "
        "PDSERVE_ADMIN_KEY",
    )
    add("--admin-key-file", metavar="PATH", help="read --admin-key from this file")
    add(
        "--internal-token",
        help="token for the workers' internal routes; or --internal-token-file, env "
        "PDSERVE_INTERNAL_TOKEN",
    )
    add("--internal-token-file", metavar="PATH", help="read --internal-token from this file")
    add("--max-body-bytes", type=int, help="answer 413 above this body size (4MiB)")
    add("--connect-timeout", type=float, help="seconds to connect to a worker (2)")
    add("--prefill-timeout", type=float, help="seconds one prefill may take (300)")
    add("--decode-timeout", type=float, help="longest silence of a decode stream, seconds (60)")
    add("--request-timeout", type=float, help="longest wait for a non-streamed answer (600)")
    add("--max-retries", type=int, help="other prefill workers tried after a failure (2)")
    add(
        "--migration-limit",
        type=int,
        help="times a request whose decode worker fails moves to another one, continuing where "
        "it stopped (3; 0: the stream ends with an error event)",
    )
    add("--health-interval", type=float, help="seconds between health checks (2)")
    add("--health-timeout", type=float, help="timeout of one health check (1)")
    add("--health-failures", type=int, help="failed checks that eject a worker (2)")
    add("--health-successes", type=int, help="good checks that readmit it (1)")
    add("--discovery-interval", type=float, help="seconds between DNS resolutions (5)")
    add("--dns-server", help="IP[:PORT] of the DNS server to ask (default: the system's)")
    add(
        "--discovery-max-workers",
        type=int,
        help=f"workers one dns:// entry may bring; beyond, the lowest addresses are kept and "
        f"the rest logged ({MAX_WORKERS})",
    )
    add(
        "--discovery-allow",
        action="append",
        metavar="CIDR",
        help="admit a discovered address only if it is in CIDR; others are dropped and logged "
        "(repeat; default: any address)",
    )
    add(
        "--rate-limit",
        action="append",
        help="KEY=RPS[:BURST]: a token bucket for that API key; KEY 'default' for every key "
        "not listed, 'anonymous' for requests without one (repeat; default: no limit)",
    )
    add(
        "--key-priority",
        action="append",
        help="KEY=high|normal|low: the class of that key's requests and the highest it may ask "
        "for; KEY 'default' for every key not listed (repeat; default: normal, no ceiling)",
    )
    add("--max-concurrency", type=int, help="requests in flight; more wait in a queue (0: off)")
    add("--max-queue", type=int, help="requests waiting for a slot; 429 beyond (1024)")
    add("--queue-timeout", type=float, help="seconds a request may wait for a slot (30)")
    add(
        "--drain-timeout",
        type=float,
        help="on SIGTERM, seconds the requests in flight get to finish before the proxy closes "
        "them (10)",
    )
    add(
        "--no-kv-routing",
        dest="kv_routing",
        action="store_const",
        const=False,
        help="do not subscribe to the workers' KV events: prefix routing hashes the prompt's "
        "first characters, as it does for workers that publish none",
    )
    add(
        "--session-affinity",
        action=argparse.BooleanOptionalAction,
        help="requests with the same X-Session-ID go to the workers that served the session "
        "last, within the load bound (default: on)",
    )
    add(
        "--max-sessions",
        type=int,
        help="sessions remembered per pool for --session-affinity; the least recent are "
        "forgotten (100000)",
    )
    add(
        "--cached-on-decode-tokens",
        type=int,
        help="a decode worker whose KV events show it holds all of a prompt but fewer tokens "
        "serves it alone, no prefill worker (64; 0: off)",
    )
    add(
        "--reverse-pull-min-tokens",
        type=int,
        help="the reverse pull: a prefill worker reads the prompt prefix that the chosen decode "
        "worker holds (its KV events) instead of computing it, when that saves at least this "
        "many tokens of what the prefill worker holds itself (32; 0: off; pull mode)",
    )
    add(
        "--workers",
        type=int,
        help="proxy processes sharing the port (SO_REUSEPORT); 0 (default): one per core the "
        "host gives the proxy (its CPU affinity and cgroup quota)",
    )
    add(
        "--http-client",
        choices=HTTP_CLIENTS,
        help="the HTTP client to the workers: lean (default; proxy/transport.py) or httpx",
    )
    add(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export a trace of each request over OTLP/HTTP to this collector, e.g. "
        "http://localhost:4318 (docs/observability.md; default: off, OpenTelemetry not loaded)",
    )
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add_limit_flags(p, show_defaults=False)
    return p


_HEALTH_FLAGS = {
    "health_interval": "interval",
    "health_timeout": "timeout",
    "health_failures": "failure_threshold",
    "health_successes": "success_threshold",
}


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> ProxyConfig:
    """Flags win over the config file, which wins over the environment (`environ`, by default
    the process's)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    try:
        file = _normalized(_read_file(a.config)) if a.config else {}
        flags = {k: v for k, v in vars(a).items() if k != "config" and v is not None}
        secrets = {n: environ[e] or None for n, e in SECRETS.items() if e in environ}
        secrets |= _take_secrets(file) | _take_secrets(flags)
        return from_dict({**file, **flags, **secrets})
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))


def _take_secrets(settings: dict) -> dict[str, str | None]:
    """Takes the secrets out of one source of settings (`NAME` or `NAME_file`): those it gives."""
    given = {}
    for name in SECRETS:
        value, path = settings.pop(name, None), settings.pop(f"{name}_file", None)
        if value is not None or path is not None:
            given[name] = pick_secret(name.replace("_", "-"), value, path)
    return given


def child_argv(argv: list[str]) -> list[str]:
    """The command line without its secrets (`--api-key KEY`, `--api-key-file PATH`, ...), for
    the `--workers N` children: they get the secrets in their environment (`secrets_env`)."""
    options = list(build_parser()._option_string_actions)  # NOTE: argparse lists them nowhere
    kept, skip_value = [], False
    for i, arg in enumerate(argv):
        if skip_value:
            skip_value = False
        elif arg == "--":
            return kept + argv[i:]
        elif _full_flag(arg.partition("=")[0], options) in SECRET_FLAGS:
            skip_value = "=" not in arg
        else:
            kept.append(arg)
    return kept


def _full_flag(flag: str, options: list[str]) -> str:
    """The option `flag` names: itself, or the one it abbreviates (argparse's prefix rule)."""
    if not flag.startswith("--") or flag in options:
        return flag
    matches = [o for o in options if o.startswith(flag)]
    return matches[0] if len(matches) == 1 else flag


def secrets_env(cfg: ProxyConfig) -> dict[str, str | None]:
    """The secrets as a child's environment variables (None: unset in the child)."""
    return {env: getattr(cfg, name) for name, env in SECRETS.items()}


def with_inherited_secrets(cfg: ProxyConfig, environ: dict) -> ProxyConfig:
    """A child's config: its secrets are those its supervisor resolved (`secrets_env`), whatever
    a config file it reads again says."""
    return replace(cfg, **{name: environ.get(env) or None for name, env in SECRETS.items()})


def from_dict(settings: dict) -> ProxyConfig:
    settings = _normalized(settings)
    health = dict(settings.pop("health", None) or {})
    for flag, name in _HEALTH_FLAGS.items():
        if flag in settings:
            health[name] = settings.pop(flag)
    limits = _normalized(settings.pop("limits", None) or {})  # a config file's "limits" table
    limits |= {name: settings.pop(name) for name in LIMIT_NAMES if name in settings}
    known = {f.name for f in fields(ProxyConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    for role in ("prefill", "decode"):
        settings[role] = tuple(settings.get(role) or ())
    allow = settings.get("discovery_allow") or ()
    settings["discovery_allow"] = (allow,) if isinstance(allow, str) else tuple(allow)
    for name in ("rate_limit", "key_priority"):
        settings[name] = _assignments(settings.get(name) or ())
    unknown = sorted(set(limits) - LIMIT_NAMES)
    if unknown:
        raise ValueError(f"unknown limits: {', '.join(unknown)}")
    return ProxyConfig(**settings, health=HealthConfig(**health), limits=limits_from(limits))


def _normalized(settings: dict) -> dict:
    return {k.replace("-", "_"): v for k, v in settings.items()}


def _assignments(value) -> tuple[str, ...]:
    """`["KEY=VALUE", ...]`, or in a config file also `{"KEY": VALUE, ...}`."""
    if isinstance(value, dict):
        return tuple(f"{k}={v}" for k, v in value.items())
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _read_file(path: Path) -> dict:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib  # Python 3.11+

        return tomllib.loads(text)
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a JSON object")
    return data
