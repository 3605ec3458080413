"""Engine configuration: frozen dataclasses that validate themselves on construction.

`EngineConfig` bundles model, cache and scheduler settings; the servers' CLI parses into it in
one place. Derived values are properties. A default is written once, on its dataclass field:
the CLI reads it from there (`default`). What a worker's role and hardware decide where the
command line says nothing (its step's token budget, its connector, its port) is `for_role`.
"""

from __future__ import annotations

import uuid
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import torch

from common.auto_dtype import DtypeChoice, choose_auto_dtype

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # an HF-format folder; None: the built-in SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str | None = None  # None: chosen at run time
    seed: int = 0
    enforce_eager: bool = False  # True: plain PyTorch; False: torch.compile (CUDA graphs on GPU)
    # decode batch sizes run as captured graphs; None: chosen (common/engine/decode_graphs.py)
    cuda_graph_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be >= 1, got {list(self.cuda_graph_sizes)}")

    def resolve_max_model_len(self, model_max: int) -> int:
        """`max_model_len`, or the model's limit (`max_position_embeddings`) where unset."""
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max}"
            )
        return self.max_model_len

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice.dtype

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The dtype the model and its KV cache run in, and why (common/auto_dtype.py)."""
        if self.dtype == "auto":
            return choose_auto_dtype(self.device)
        return DtypeChoice(_DTYPES[self.dtype], "set explicitly")

    @property
    def model_dir(self) -> Path:
        if self.model is not None:
            return Path(self.model)
        from common.model.default_model import default_model_dir

        return default_model_dir()


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_cache_memory when set
    kv_cache_memory: int = 1 << 30  # bytes
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the token budget of one step
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


def _grammar(default: int, flag: str, help: str):
    return field(default=default, metadata={"flag": flag, "help": help})


@dataclass(frozen=True)
class GrammarConfig:
    """What one structured output may cost (common/engine/structured.py; docs/security.md,
    "Grammar cost"): the rows a request may add to every step, time budgets to compile and for
    each step's mask, and llguidance's own parser limits (`LLParserLimits`). Each field is one
    worker flag (`flag`)."""

    max_rows: int = _grammar(
        16, "--max-grammar-rows", "choices (n) of a request with a grammar: each is a row of "
        "every step's masks",
    )  # fmt: skip
    compile_budget_ms: int = _grammar(
        500, "--grammar-compile-budget-ms", "ms a grammar may take to compile, its first mask "
        "included, off the engine thread; over it is a 400",
    )  # fmt: skip
    mask_budget_ms: int = _grammar(
        20, "--grammar-mask-budget-ms", "ms a step waits for its grammar masks after the "
        "forward; a request whose mask is later ends with grammar_too_expensive",
    )  # fmt: skip
    max_grammar_size: int = _grammar(
        10_000, "--grammar-max-size", "symbols of a grammar (llguidance's max_grammar_size; "
        "its default 500000)",
    )  # fmt: skip
    lexer_fuel: int = _grammar(
        100_000, "--grammar-lexer-fuel", "work to build a grammar's lexer (llguidance's "
        "initial_lexer_fuel; its default 1000000)",
    )  # fmt: skip
    step_lexer_fuel: int = _grammar(
        200_000, "--grammar-step-fuel", "lexer work of one mask (llguidance's step_lexer_fuel)"
    )
    step_max_items: int = _grammar(
        50_000, "--grammar-step-items", "parser items of one mask (llguidance's step_max_items)"
    )
    max_items_in_row: int = _grammar(
        2_000, "--grammar-row-items", "items of one parser row (llguidance's max_items_in_row)"
    )
    max_lexer_states: int = _grammar(
        20_000, "--grammar-lexer-states", "lexer states of a grammar, ~1-2 kB each "
        "(llguidance's max_lexer_states; its default 250000)",
    )  # fmt: skip

    @staticmethod
    def flag(name: str) -> str:
        """The worker flag that sets field `name`."""
        return next(f.metadata["flag"] for f in fields(GrammarConfig) if f.name == name)

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{self.flag(f.name)} must be >= 1, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class TransferConfig:
    """KV transfer between workers. `connector=None`: none (colocated serving only)."""

    connector: str | None = None  # "nixl"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    advertise_host: str = "127.0.0.1"  # where peers reach this worker's HTTP port
    advertise_port: int = 0
    lease_timeout: float = 60.0  # P: seconds a remote reader gets before held blocks are freed
    load_timeout: float = 30.0  # D: seconds a remote read may take before it counts as failed
    failure_policy: str = "recompute"  # D: when KV does not arrive: "fail" or "recompute"
    kv_checksum: bool = False  # P sends per-layer block checksums; D verifies before decoding

    def __post_init__(self) -> None:
        if self.connector not in (None, "nixl"):  # common.kv_transfer.CONNECTORS
            raise ValueError(f"kv_connector must be nixl or none, got {self.connector!r}")
        if self.failure_policy not in ("fail", "recompute"):
            raise ValueError(
                f"kv_load_failure_policy must be fail or recompute, got {self.failure_policy!r}"
            )
        if self.lease_timeout <= 0 or self.load_timeout <= 0:
            raise ValueError("kv lease and load timeouts must be > 0 seconds")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (common/parallel/): the model's heads, MLP columns and vocabulary are
    split across `tensor_parallel_size` ranks, rank 0 being the engine itself."""

    tensor_parallel_size: int = 1
    # seconds rank 0 waits in one collective before the group counts as hung (a rank that
    # dies is noticed at once: its sockets close and its process is watched)
    tp_timeout: float = 300.0
    # pin each rank to its run of the cores (the worker's --cpu-cores); else only the torch
    # threads are split and ranks float over the process's mask, as a TP = 1 worker does
    pin_ranks: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_timeout <= 0:
            raise ValueError(f"tp_timeout must be > 0 seconds, got {self.tp_timeout}")


_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class CurveServerKeys:
    """A KV events publisher's CURVE keys (Z85 text): its own secret key, and the public keys of
    the subscribers it admits."""

    secret_key: str
    client_public_keys: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.client_public_keys:
            raise ValueError("kv_events CURVE needs the public key of at least one subscriber")
        for key in (self.secret_key, *self.client_public_keys):
            if len(key) != 40:
                raise ValueError("a kv_events CURVE key is 40 characters of Z85 text")

    def __repr__(self) -> str:  # never log a secret
        return f"CurveServerKeys(<secret>, {len(self.client_public_keys)} subscribers)"


@dataclass(frozen=True)
class KVEventsConfig:
    """Prefix-cache changes published over ZMQ in vLLM's KV events format
    (common/kv_cache/event_publisher.py). `endpoint=None`: off."""

    endpoint: str | None = None  # PUB; binds with a wildcard host (tcp://*:5557), else connects
    replay_endpoint: str | None = None  # ROUTER (always bound) resending buffered batches
    topic: str = ""
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 1000  # ZMQ send high-water mark per subscriber: past it, a slow one misses batches
    bind_host: str | None = None  # the worker's --host: where a wildcard endpoint binds
    replay_rate: float = 2000.0  # replayed batches a second per peer host (burst: buffer_steps)
    curve: CurveServerKeys | None = None  # CURVE: encrypt, and admit only these subscribers

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_ZMQ_TRANSPORTS):
                raise ValueError(
                    f"kv_events {name} must be a tcp://, ipc:// or inproc:// ZMQ "
                    f"endpoint, got {value!r}"
                )
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("a kv_events replay endpoint needs a kv_events endpoint")
        if min(self.max_queue_size, self.buffer_steps, self.hwm) < 1:
            raise ValueError("kv_events queue size, buffer steps and hwm must be >= 1")
        if not self.replay_rate > 0:
            raise ValueError("kv_events replay rate must be > 0")

    @property
    def is_enabled(self) -> bool:
        return self.endpoint is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        cuda = torch.device(self.model.device).type == "cuda"
        if tp > 1 and cuda and self.transfer.connector is not None:
            raise ValueError(
                f"P/D KV transfer (kv_connector {self.transfer.connector}) on CUDA needs "
                f"tensor_parallel_size 1, got {tp}: each rank's KV is in its own GPU's memory, "
                "which one NIXL agent cannot register (a NIXL agent per rank is not built yet); "
                "use kv_connector none (colocated serving), or TP > 1 on CPU"
            )


def default(cls: type, name: str):
    """The default of dataclass `cls`'s field `name` (its factory's value for a factory)."""
    f = next((f for f in fields(cls) if f.name == name), None)
    assert f is not None, f"{cls.__name__} has no field {name!r}"
    if f.default_factory is not MISSING:
        return f.default_factory()
    assert f.default is not MISSING, f"{cls.__name__}.{name} has no default"
    return f.default


# A prefill worker on a CPU gets a small step: there prefill is compute-bound from ~128 tokens a
# step on (docs/benchmarks.md, "A prefill worker's step"), so a bigger step adds no throughput,
# only makes the prompts it batches finish together at its end; with 256, prompts that arrive
# together finish one after another, in arrival order, and the mean TTFT of a burst drops by a
# third.
PREFILL_CPU_STEP_TOKENS = 256
ROLE_PORTS = {"prefill": 8100, "decode": 8200}


@dataclass(frozen=True)
class RoleDefaults:
    """What a worker's role and hardware decide where its command line says nothing."""

    port: int
    max_num_batched_tokens: int  # the step's token budget
    connector: str | None  # None: no KV transfer (colocated serving only)
    cuda_graph_sizes: tuple[int, ...] | None  # None: chosen (common/engine/decode_graphs.py)


def for_role(role: str, device: str, tensor_parallel_size: int) -> RoleDefaults:
    """A prefill worker on a CPU steps `PREFILL_CPU_STEP_TOKENS`, and captures no CUDA graphs
    (it decodes one token a request); a CUDA worker at TP > 1 has no connector, since
    `EngineConfig` refuses NIXL there; everyone else gets the dataclasses' defaults and NIXL."""
    is_cpu = torch.device(device).type == "cpu"
    step = default(SchedulerConfig, "max_num_batched_tokens")
    return RoleDefaults(
        port=ROLE_PORTS[role],
        max_num_batched_tokens=PREFILL_CPU_STEP_TOKENS if role == "prefill" and is_cpu else step,
        connector=None if tensor_parallel_size > 1 and not is_cpu else "nixl",
        cuda_graph_sizes=() if role == "prefill" else default(ModelConfig, "cuda_graph_sizes"),
    )
