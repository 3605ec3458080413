"""The one place the workers' command line becomes configuration.

`parse_args(role, argv)` returns the engine's `EngineConfig` and the server's `ServerConfig`;
`--help` explains every flag. Every default is read from its config dataclass's field
(`common.config.default`), and what the role decides from `common.config.for_role`: a default
is written once, there, and `--help` shows it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import socket

from common.api.limits import add_limit_flags, limits_from
from common.api.server_config import ServerConfig
from common.config import (
    PREFILL_CPU_STEP_TOKENS,
    ROLE_PORTS,
    CacheConfig,
    CurveServerKeys,
    EngineConfig,
    GrammarConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    TransferConfig,
    default,
    for_role,
)
from common.cpu import CpuBudget, parse_cpu_list
from common.credentials import pick_secret
from common.kv_cache import curve_keys
from common.kv_cache.event_publisher import open_addresses
from common.settings import Settings

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def parse_size(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5GB' → bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    value, unit, binary = float(m[1]), m[2].upper(), m[3]
    base = 1024 if binary or not unit else 1000
    return int(value * base ** "_KMGT".index(unit or "_"))


def format_size(num_bytes: int) -> str:
    """Bytes as `--help` shows a size: 1073741824 → '1GiB'."""
    for unit in "TGMK":
        scale = 1024 ** ("_KMGT".index(unit))
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}iB"
    return str(num_bytes)


def parse_cores(text: str) -> frozenset[int]:
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_kv_host(kv_host: str | None, host: str) -> str:
    """The address peers are told to reach this worker at (`--kv-host`, see its help)."""
    if kv_host is None:
        return host
    if kv_host != "auto":
        return kv_host
    if host not in WILDCARD_HOSTS:  # the side channel listens there and nowhere else
        return host
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as e:
        raise ValueError(
            f"--kv-host auto: this host's name {name!r} does not resolve ({e}); "
            "pass --kv-host ADDRESS"
        ) from None
    if ipaddress.ip_address(address).is_loopback:
        raise ValueError(
            f"--kv-host auto: this host's name {name!r} resolves to {address}, a loopback "
            "address that peers on other hosts cannot reach; pass --kv-host ADDRESS"
        )
    return address


def build_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {role}_server",
        description=f"The {role} worker: an OpenAI-compatible server.",
    )
    _add_model_args(p, role)
    _add_scheduler_args(p)
    _add_grammar_args(p)
    _add_server_args(p, role)
    add_limit_flags(p)
    _add_kv_transfer_args(p)
    _add_kv_events_args(p)
    _add_cpu_budget(p)
    return p


def _add_model_args(p: argparse.ArgumentParser, role: str) -> None:
    add = p.add_argument_group("model").add_argument
    add(
        "--model",
        default=None,
        help="HF-format model folder (default: the built-in "
        "SmolLM2-135M-Instruct, prepared on first use)",
    )
    add(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model folder's name)",
    )
    add(
        "--device",
        default=default(ModelConfig, "device"),
        choices=["cpu", "cuda"],
        help="where the model runs (default %(default)s)",
    )
    add(
        "--dtype",
        default=default(ModelConfig, "dtype"),
        help="auto (bf16 on CUDA and on CPUs with avx512_bf16/amx_bf16, else fp32), "
        "float32, float16, bfloat16 (default %(default)s)",
    )
    add(
        "--max-model-len",
        type=int,
        default=default(ModelConfig, "max_model_len"),
        help="longest prompt + output in tokens (default: the model's limit)",
    )
    add(
        "--attention-backend",
        default=default(ModelConfig, "attention_backend"),
        choices=["torch", "flash"],
        help="force an attention backend (default: flash when it fits, else torch)",
    )
    add(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=default(ModelConfig, "enforce_eager"),
        help="run the model in plain PyTorch: no torch.compile, no packed GEMMs, no CUDA graphs "
        "(default: compiled at start-up; inductor's cache in TORCHINDUCTOR_CACHE_DIR keeps "
        "restarts fast)",
    )
    add(
        "--cuda-graph-sizes",
        type=int,
        nargs="*",
        default=None,  # common.config.for_role: none for P, which decodes one token a request
        metavar="N",
        help="decode batch sizes replayed as captured CUDA graphs; a batch runs the smallest size "
        "that holds it (default for a decode or colocated worker on CUDA with the flash backend: "
        "1 2 4 8 16 24 32 48 64 96 128 192 256 up to --max-num-seqs, and it; none given, or a "
        "prefill worker: no graphs). On a CPU, sizes given run decodes through the same padded "
        "static buffers, uncaptured: a check, not a speed-up",
    )
    add(
        "--seed",
        type=int,
        default=default(ModelConfig, "seed"),
        help="seed of the engine's global RNG (default %(default)s)",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=default(ParallelConfig, "tensor_parallel_size"),
        help="split the model over N ranks (Megatron-style: heads, MLP columns, vocabulary): "
        "rank 0 is this process, ranks 1..N-1 are processes it starts, one per GPU (cuda:r) or "
        "per share of the CPU budget; on CPU its KV moves to and from workers of any TP size; on "
        "CUDA no P/D KV transfer at N > 1 yet (default %(default)s)",
    )


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument_group("KV cache and scheduler").add_argument
    add(
        "--block-size",
        type=int,
        default=default(CacheConfig, "block_size"),
        help="tokens per KV block (default %(default)s)",
    )
    add(
        "--num-blocks",
        type=int,
        default=default(CacheConfig, "num_blocks"),
        help="KV blocks in the pool (wins over --kv-cache-memory)",
    )
    memory = default(CacheConfig, "kv_cache_memory")
    add(
        "--kv-cache-memory",
        type=parse_size,
        default=memory,
        help="KV cache budget of the worker, all tensor-parallel ranks together, e.g. 2GiB "
        f"(default {format_size(memory)})",
    )
    assert default(CacheConfig, "enable_prefix_caching"), "--no-prefix-caching turns it off"
    add("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    add(
        "--max-num-seqs",
        type=int,
        default=default(SchedulerConfig, "max_num_seqs"),
        help="most requests in one batch (default %(default)s)",
    )
    step_tokens = default(SchedulerConfig, "max_num_batched_tokens")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=None,  # common.config.for_role
        help="token budget of one step (prefills are chunked to it); default "
        f"{PREFILL_CPU_STEP_TOKENS} for a prefill worker on CPU (a bigger step there only delays "
        f"the first prompts of a batch), else {step_tokens}",
    )
    add(
        "--arrival-wait-ms",
        type=float,
        default=default(ServerConfig, "arrival_wait") * 1e3,
        help="an idle engine waits up to this long for requests it has already received "
        "(still being parsed and tokenized) before its next step, so that requests arriving "
        "together start as one batch; 0 turns it off (default %(default)s)",
    )


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "grammar cost", "what one structured output may cost (docs/security.md, Grammar cost)"
    )
    for f in dataclasses.fields(GrammarConfig):
        help = f"the most {f.metadata['help']} (default {f.default})"
        flag = f.metadata["flag"]
        group.add_argument(flag, dest=f.name, type=int, default=f.default, metavar="N", help=help)


def grammar_config(a: argparse.Namespace) -> GrammarConfig:
    return GrammarConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(GrammarConfig)})


def _add_server_args(p: argparse.ArgumentParser, role: str) -> None:
    add = p.add_argument_group("HTTP server").add_argument
    add(
        "--host",
        default=default(ServerConfig, "host"),
        help="address to bind (default %(default)s)",
    )
    add("--port", type=int, default=ROLE_PORTS[role], help="port (default %(default)s)")
    add(
        "--max-waiting",
        type=int,
        default=default(ServerConfig, "max_waiting"),
        help="answer 429 when this many requests already wait (default %(default)s)",
    )
    body = default(ServerConfig, "max_body_bytes")
    add(
        "--max-body-bytes",
        type=parse_size,
        default=body,
        help=f"answer 413 above this request body size (default {format_size(body)})",
    )
    add(
        "--drain-timeout",
        type=float,
        default=default(ServerConfig, "drain_timeout"),
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted "
        "(default %(default)s)",
    )
    add(
        "--drain-migrate",
        action="store_true",
        help="on SIGTERM, end every in-flight generation at once (a streamed one with a "
        "'worker_draining' error event, others with a 503) so that the proxy moves it to "
        "another worker, instead of waiting --drain-timeout for it",
    )
    add(
        "--internal-token",
        default=None,
        help="cluster token: internal routes (handshake, reserve, release) refuse requests "
        "without it, and peers are sent it (default: env PDSERVE_INTERNAL_TOKEN); a flag is "
        "readable by every user of the host: prefer --internal-token-file or the environment",
    )
    add("--internal-token-file", metavar="PATH", help="read --internal-token from this file")
    add(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read from the model's output with tool_choice 'auto': hermes "
        "(<tool_call> JSON blocks: Qwen, SmolLM, Hermes) or llama3_json (default: llama3_json "
        "for a Llama 3 chat template, else hermes)",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export a trace of each request over OTLP/HTTP to this collector, e.g. "
        "http://localhost:4318 (docs/observability.md; default: off, OpenTelemetry not loaded)",
    )
    add(
        "--log-level",
        default=default(ServerConfig, "log_level"),
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )


def _add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument_group("KV transfer").add_argument
    add(
        "--kv-connector",
        default=None,  # common.config.for_role
        choices=["nixl", "none"],
        help="how KV moves between prefill and decode workers (default nixl, and none for a "
        "CUDA worker with --tensor-parallel-size > 1, where transfer is not built yet; none: "
        "colocated serving only)",
    )
    add(
        "--kv-host",
        default=None,
        help="the address peers use to reach this worker (default: --host); auto: --host when "
        "it names one address, else this host's own (its hostname resolved at start-up: a "
        "container's IP on its network), refused if that is a loopback address",
    )
    add(
        "--kv-lease-timeout",
        type=float,
        default=default(TransferConfig, "lease_timeout"),
        help="prefill: seconds a decode worker "
        "gets to read a request's KV before its blocks are freed (default %(default)s)",
    )
    add(
        "--kv-load-timeout",
        type=float,
        default=default(TransferConfig, "load_timeout"),
        help="decode: seconds a KV read may take before it counts as failed (default %(default)s)",
    )
    add(
        "--kv-load-failure-policy",
        default=default(TransferConfig, "failure_policy"),
        choices=["fail", "recompute"],
        help="decode: when KV does not arrive, fail the request or compute the prompt locally "
        "(default %(default)s)",
    )
    assert not default(TransferConfig, "kv_checksum"), "--kv-checksum turns it on"
    add(
        "--kv-checksum",
        action="store_true",
        help="prefill: send a checksum per layer and block with the KV; decode: verify "
        "received KV before decoding (a mismatch is a failed load: --kv-load-failure-policy)",
    )


def _add_kv_events_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument_group(
        "KV events",
        "Publish prefix-cache changes (BlockStored, BlockRemoved, AllBlocksCleared) over ZMQ in "
        "vLLM's KV events format, for KV-aware routers (docs/interop.md).",
    ).add_argument
    add(
        "--kv-events-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint, e.g. tcp://*:5557: bound when its host is a wildcard (or ipc://, "
        "inproc://), connected to otherwise, as vLLM does; a wildcard binds --host only, not "
        "every interface (default: off)",
    )
    add(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint (bound; a wildcard on --host) that resends buffered batches "
        "from a sequence number, e.g. tcp://*:5558, a few at a time under a budget per "
        "subscriber host (default: none)",
    )
    add(
        "--kv-events-topic",
        default=default(KVEventsConfig, "topic"),
        help="topic frame of every message (default: empty)",
    )
    add(
        "--kv-events-queue-size",
        type=int,
        default=default(KVEventsConfig, "max_queue_size"),
        help="event batches waiting to be sent; past it batches are dropped and counted "
        "(pdserve_kv_events_dropped_total; default %(default)s)",
    )
    add(
        "--kv-events-hwm",
        type=int,
        default=default(KVEventsConfig, "hwm"),
        metavar="N",
        help="batches queued per subscriber (ZMQ's send high-water mark; default %(default)s); a "
        "slower subscriber misses batches past it and catches up by replay. CURVE "
        "authentication is set by environment: PDSERVE_KV_EVENTS_SERVER_SECRET_KEY and "
        "PDSERVE_KV_EVENTS_CLIENT_KEYS (or their _FILE twins; docs/security.md)",
    )
    add(
        "--kv-events-require-curve",
        action="store_true",
        help="refuse to start when a KV events socket would be bound on TCP without CURVE keys "
        "(without this flag the worker starts and warns; compose and Kubernetes set it)",
    )


def kv_events_curve(environ: dict[str, str] | None = None) -> CurveServerKeys | None:
    """The KV events publisher's CURVE keys, from the environment (common/kv_cache/curve_keys.py);
    None when its secret key is not set."""
    try:
        secret = curve_keys.read_key(curve_keys.SERVER_SECRET_KEY, environ)
        clients = curve_keys.read_keys(curve_keys.CLIENT_KEYS, environ)
    except OSError as e:
        raise ValueError(f"KV events CURVE keys: {e}") from None
    return None if secret is None else CurveServerKeys(secret, clients)


def _add_cpu_budget(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "CPU budget",
        "Workers that share a machine should not share cores: two processes with one torch "
        "thread per core each slow each other down (python -m deploy.local splits the cores).",
    )
    group.add_argument(
        "--cpu-cores",
        type=parse_cores,
        default=None,
        metavar="LIST",
        help="pin the whole process (engine, NIXL/UCX and tokenizer threads) to these cores, "
        "e.g. 0-1 or 0,2; each must be in the affinity mask it starts with (default: that mask); "
        "with --tensor-parallel-size N each rank is pinned to its run of them",
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads of the engine (default: one per core of --cpu-cores, or "
        "OMP_NUM_THREADS when set)",
    )


def _internal_token(a: argparse.Namespace) -> str | None:
    """--internal-token or --internal-token-file, else env PDSERVE_INTERNAL_TOKEN."""
    if a.internal_token is None and a.internal_token_file is None:
        return Settings.from_env().internal_token
    return pick_secret("internal-token", a.internal_token, a.internal_token_file)


def parse_args(role: str, argv: list[str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    parser = build_parser(role)
    a = parser.parse_args(argv)
    policy = for_role(role, a.device, a.tensor_parallel_size)
    connector = policy.connector if a.kv_connector is None else a.kv_connector
    graph_sizes = policy.cuda_graph_sizes if a.cuda_graph_sizes is None else a.cuda_graph_sizes
    step_tokens = a.max_num_batched_tokens
    if step_tokens is None:
        step_tokens = policy.max_num_batched_tokens
    try:
        engine = EngineConfig(
            model=ModelConfig(
                model=a.model,
                device=a.device,
                dtype=a.dtype,
                max_model_len=a.max_model_len,
                attention_backend=a.attention_backend,
                seed=a.seed,
                enforce_eager=a.enforce_eager,
                cuda_graph_sizes=None if graph_sizes is None else tuple(graph_sizes),
            ),
            cache=CacheConfig(
                block_size=a.block_size,
                num_blocks=a.num_blocks,
                kv_cache_memory=a.kv_cache_memory,
                enable_prefix_caching=not a.no_prefix_caching,
            ),
            transfer=TransferConfig(
                connector=None if connector == "none" else connector,
                advertise_host=resolve_kv_host(a.kv_host, a.host),
                advertise_port=a.port,
                lease_timeout=a.kv_lease_timeout,
                load_timeout=a.kv_load_timeout,
                failure_policy=a.kv_load_failure_policy,
                kv_checksum=a.kv_checksum,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=step_tokens,
            ),
            grammar=grammar_config(a),
            parallel=ParallelConfig(
                tensor_parallel_size=a.tensor_parallel_size, pin_ranks=a.cpu_cores is not None
            ),
            kv_events=KVEventsConfig(
                endpoint=a.kv_events_endpoint,
                replay_endpoint=a.kv_events_replay_endpoint,
                topic=a.kv_events_topic,
                max_queue_size=a.kv_events_queue_size,
                hwm=a.kv_events_hwm,
                bind_host=a.host,
                curve=kv_events_curve(),
            ),
        )
        server = ServerConfig(
            role=role,
            host=a.host,
            port=a.port,
            served_model_name=a.served_model_name,
            max_waiting=a.max_waiting,
            arrival_wait=a.arrival_wait_ms / 1e3,
            max_body_bytes=a.max_body_bytes,
            drain_timeout=a.drain_timeout,
            drain_migrate=a.drain_migrate,
            tool_call_parser=a.tool_call_parser,
            internal_token=_internal_token(a),
            otlp_traces_endpoint=a.otlp_traces_endpoint,
            log_level=a.log_level,
            cpu=CpuBudget(cores=a.cpu_cores, num_threads=a.cpu_threads),
            limits=limits_from(vars(a)),
        )
        if a.kv_events_require_curve:
            _require_curve(engine.kv_events)
    except ValueError as e:
        parser.error(str(e))
    return engine, server


def _require_curve(cfg: KVEventsConfig) -> None:
    if unauthenticated := open_addresses(cfg):
        raise ValueError(
            f"--kv-events-require-curve: {' and '.join(unauthenticated)} would be bound without "
            f"CURVE keys; set {curve_keys.SERVER_SECRET_KEY} and {curve_keys.CLIENT_KEYS} (or "
            "their _FILE twins; docs/security.md)"
        )
