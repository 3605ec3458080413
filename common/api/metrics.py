"""Prometheus metrics of one server, in its own registry (so tests can run several apps).

Counters and histograms are recorded as requests run; the engine's gauges (running, waiting,
KV blocks, prefix-cache hit rate), and its running totals and histograms (KV transfers, grammar
time), are read from the engine's last stats (`EngineStats`) at scrape time. A connector's
totals (`KVTransferStats`) keep their field names up to here: `KV_TRANSFER_COUNTERS` and
`KV_TRANSFER_GAUGES` say which metric reads which field.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from common.engine.stats import EngineStats
from common.engine.structured import GrammarSeconds
from common.kv_transfer.transfers import DescriptorHistogram, RunningHistogram, SecondsHistogram
from common.native.choice import choices as kernel_choices

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


LOAD_MODES = ("pull", "push", "reverse")  # reverse: P read a prompt prefix from D
RECOMPUTE_REASONS = (
    "read_failed",
    "lease_expired",
    "checksum_mismatch",
    "remote_blocks_mismatch",
    "push_incomplete",
    "prefill_unreachable",
    "prefix_unreachable",  # P: the decode worker that lent a prefix could not be reached
)


# The connector's running totals (`KVTransferStats`, common/kv_transfer/base.py) on /metrics:
# each counter's name, the field it reads, and its help. The one place a stat is named anew.
KV_TRANSFER_COUNTERS = (
    ("pdserve_kv_transfers", "num_loads", "KV loads from a prefill worker (one per request)"),
    ("pdserve_kv_transfer_failures", "num_load_failures", "KV loads that failed or timed out"),
    ("pdserve_kv_transfer_bytes", "num_bytes_loaded", "Bytes of KV loaded over NIXL"),
    (
        "pdserve_kv_transfer_seconds",
        "seconds_loading",
        "Seconds from the first read issued to the load done",
    ),
    (
        "pdserve_kv_transfer_descriptors",
        "num_load_descriptors",
        "NIXL descriptors in KV loads (one per run per K/V per layer)",
    ),
    (
        "pdserve_kv_lease_expiries",
        "num_lease_expiries",
        "Held prefill blocks freed because their lease expired",
    ),
    ("pdserve_kv_push_bytes", "num_bytes_pushed", "Bytes of KV pushed (WRITE) to decode workers"),
    (
        "pdserve_kv_push_seconds",
        "seconds_pushing",
        "Seconds from a step's first KV WRITE to its last landing",
    ),
    (
        "pdserve_kv_push_exposed_seconds",
        "seconds_push_exposed",
        "Of kv_push_seconds, the part after the forward",
    ),
    (
        "pdserve_kv_push_failures",
        "num_push_failures",
        "Pushes that failed: P, requests with a failed KV WRITE; D, reservations given up or"
        " expired before every chunk landed",
    ),
    (
        "pdserve_kv_checksum_failures",
        "num_checksum_failures",
        "KV loads whose checksum did not match P's",
    ),
    (
        "pdserve_kv_push_held_blocks",
        "num_push_blocks_held",
        "Blocks of pushed prompts a decode worker had cached already (an earlier turn's),"
        " reserved from its own cache and not written by P",
    ),
)
# ... and its gauges
KV_TRANSFER_GAUGES = (
    (
        "pdserve_kv_blocks_held",
        "num_blocks_held",
        "Blocks held for remote readers (P: prompts for D; D: prefixes lent to P)",
    ),
    (
        "pdserve_kv_blocks_in_transfer",
        "num_blocks_in_transfer",
        "KV blocks a NIXL transfer still reads or writes (held until it settles)",
    ),
    (
        "pdserve_kv_blocks_quarantined",
        "num_blocks_quarantined",
        "KV blocks given up by their request but held until transfers into them settle",
    ),
    (
        "pdserve_kv_pushes_in_flight",
        "num_pushes_in_flight",
        "Prefill worker: push requests whose KV writes have not all settled",
    ),
)


class _EngineTotalsCollector:
    """The engine's running totals, read from its last stats at each scrape: the connector's
    counters and gauges (the tables above), requests by where their KV came from, the
    transports its peers use, KV event batches dropped, grammar refusals. Every label value a
    counter can take is there from the start, at 0."""

    def __init__(self) -> None:
        self.stats = EngineStats()

    def collect(self):
        stats, kv = self.stats, self.stats.kv
        for name, field_name, doc in KV_TRANSFER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(kv, field_name))
        for name, field_name, doc in KV_TRANSFER_GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(kv, field_name))
        yield CounterMetricFamily(
            "pdserve_kv_events_dropped",
            "KV event batches dropped because the publisher's queue was full",
            value=stats.num_kv_events_dropped,
        )
        yield _by_label(
            "pdserve_kv_loaded_requests",
            "Requests computed from transferred KV, by mode: pull, push (decode worker), "
            "reverse (prefill worker, a prompt prefix read from a decode worker)",
            "mode",
            LOAD_MODES,
            kv.loaded_requests,
        )
        yield _by_label(
            "pdserve_kv_recomputed",
            "Requests whose transferred KV (prompt, or prefix on a prefill worker) was "
            "computed here instead, by reason",
            "reason",
            RECOMPUTE_REASONS,
            kv.recomputed,
        )
        yield _by_label(
            "pdserve_grammar_refusals",
            "Requests refused at admission, or ended, for their grammar's cost, by reason:"
            " compile_budget, compile_limit, rows, mask_budget, stream_limit (docs/security.md)",
            "reason",
            (),
            stats.grammar_refusals,
        )
        yield _transports(kv.peer_transports)


def _transports(peer_transports: dict[str, frozenset[str]]) -> GaugeMetricFamily:
    """`pdserve_kv_transport_info{peer, transport}` = 1: the transports of the KV READs or
    WRITEs this worker initiates with each peer, as the connector's transport reported them
    (NIXL: UCX's choice, common/kv_transfer/nixl/transport_info.py)."""
    family = GaugeMetricFamily(
        "pdserve_kv_transport_info",
        "UCX transports of the KV transfers this worker initiates with a NIXL peer (1 each),"
        " as UCX reported its choice: cuda_ipc (NVLink/PCIe), cma (host memory), rc_*"
        " (RDMA), tcp; unknown when UCX did not say",
        labels=["peer", "transport"],
    )
    for peer, transports in sorted(peer_transports.items()):
        for transport in sorted(transports):
            family.add_metric([peer, transport], 1)
    return family


def _by_label(
    name: str, doc: str, label: str, known: tuple[str, ...], totals: dict[str, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value in sorted(set(known) | set(totals)):
        family.add_metric([value], totals.get(value, 0))
    return family


class _RunningHistogramCollector:
    """A histogram by op (read: pull, on D; write: push, on P; or `ops`) of the engine's running
    histograms (common/kv_transfer/transfers.py), set from its stats at each scrape."""

    def __init__(
        self,
        name: str,
        doc: str,
        empty: type[RunningHistogram],
        ops: tuple[str, ...] = ("read", "write"),
    ) -> None:
        self.name, self.doc, self.empty, self.ops = name, doc, empty, ops
        self.histograms: dict[str, RunningHistogram] = {}

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["op"])
        for op in self.ops:
            histogram = self.histograms.get(op, self.empty())
            bounds = [str(float(b)) for b in histogram.BUCKETS] + ["+Inf"]
            cumulative, running = [], 0
            for bound, count in zip(bounds, histogram.counts, strict=True):
                running += count
                cumulative.append((bound, running))
            family.add_metric([op], cumulative, histogram.total)
        yield family


class _KernelCollector:
    """`pdserve_kernel_path{kernel, shape, path}` = 1: what each CPU kernel runs, per shape
    class, as chosen at start-up (common/native/choice.py)."""

    def collect(self):
        family = GaugeMetricFamily(
            "pdserve_kernel_path",
            "The implementation each CPU kernel runs per shape class (1 each), chosen at start-up"
            " by timing the candidates on this CPU: c-avx512, c-avx2, c-plain, torch, onednn",
            labels=["kernel", "shape", "path"],
        )
        for choice in kernel_choices():
            family.add_metric([choice.kernel, choice.shape, choice.path], 1)
        yield family


class ServerMetrics:
    def __init__(self, role: str):
        self.registry = r = CollectorRegistry()
        labels = {"role": role}
        self.requests = Counter(
            "pdserve_requests",
            "Finished HTTP requests by status code",
            ["role", "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "A finished request's time per output token after its first (2 tokens or more)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_step = Histogram(
            "pdserve_first_step_seconds",
            "The engine's part of the time to first token: the request handed to the engine to"
            " its first output token here (on D after a remote prefill: its first decode step,"
            " with the wait for pushed KV or, in pull mode, the KV load it overlaps)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request latency, end to end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens", registry=r
        )
        self.running = Gauge(
            "pdserve_num_requests_running", "Requests in the running batch", registry=r
        )
        self.waiting = Gauge(
            "pdserve_num_requests_waiting", "Requests waiting to be scheduled", registry=r
        )
        self.arriving = Gauge(
            "pdserve_num_requests_arriving",
            "Requests received and not yet handed to the engine (parsing, tokenizing)",
            registry=r,
        )
        self.blocks_used = Gauge(
            "pdserve_kv_blocks_used", "KV blocks referenced by requests", registry=r
        )
        self.blocks_free = Gauge(
            "pdserve_kv_blocks_free", "KV blocks allocatable now (empty or evictable)", registry=r
        )
        self.hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate",
            "Prefix-cache hits / queries (full blocks), since start",
            registry=r,
        )
        self.preemptions = Gauge("pdserve_num_preemptions", "Preemptions since start", registry=r)
        self.graph_steps = Gauge(
            "pdserve_num_graph_steps",
            "Decode steps replayed as a CUDA graph since start (on a CPU, with "
            "--cuda-graph-sizes: run through the graphs' static buffers)",
            registry=r,
        )
        self.info = Gauge("pdserve_info", "Server role", ["role"], registry=r)
        self.info.labels(**labels).set(1)
        self.role = role
        self.cpu_threads = Gauge(
            "pdserve_cpu_threads", "Torch intra-op threads of the engine thread", registry=r
        )
        self.cpu_cores = Gauge("pdserve_cpu_cores", "Cores the process may run on", registry=r)
        self.compile_seconds = Gauge(
            "pdserve_model_compile_seconds",
            "Seconds the model's compiled forward took to build at start-up (0: eager)",
            registry=r,
        )
        self.ignored_fields = Counter(
            "pdserve_ignored_fields",
            "Unknown request fields ignored, by name (the first 32 names; then 'other')",
            ["field"],
            registry=r,
        )
        self.descriptors = _RunningHistogramCollector(
            "pdserve_kv_descriptors",
            "NIXL descriptors a layer per request's KV transfer (2: its blocks are one run on"
            " both sides; 2 per run otherwise), by op: read (pull, on D), write (push, on P)",
            DescriptorHistogram,
        )
        r.register(self.descriptors)
        self.transfer_seconds = _RunningHistogramCollector(
            "pdserve_kv_transfer_request_seconds",
            "One request's KV transfer, by op: read (pull, on D: its first READ to its load"
            " done), write (push, on P: its first WRITE to its last one landing)",
            SecondsHistogram,
        )
        r.register(self.transfer_seconds)
        self.grammar_seconds = _RunningHistogramCollector(
            "pdserve_grammar_seconds",
            "Structured outputs' grammar time, by op: compile (a spec's grammar and its first"
            " mask, on the compile threads), mask (one row's token mask in one step)",
            GrammarSeconds,
            ops=("compile", "mask"),
        )
        r.register(self.grammar_seconds)
        self.handshakes = Counter(
            "pdserve_kv_handshakes", "Handshakes with a new KV peer", registry=r
        )
        self.totals = _EngineTotalsCollector()
        r.register(self.totals)
        r.register(_KernelCollector())

    def set_cpu(self, num_threads: int, num_cores: int) -> None:
        self.cpu_threads.set(num_threads)
        self.cpu_cores.set(num_cores)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(role=self.role, endpoint=endpoint, status=str(status)).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.blocks_used.set(stats.num_blocks_used)
            self.blocks_free.set(stats.num_blocks_free)
            queries = stats.prefix_cache_queries
            self.hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
            self.preemptions.set(stats.num_preemptions)
            self.graph_steps.set(stats.num_graph_steps)
            self.descriptors.histograms = stats.kv.descriptors
            self.transfer_seconds.histograms = stats.kv.seconds
            self.grammar_seconds.histograms = stats.grammar_seconds
            self.totals.stats = stats
        return generate_latest(self.registry)
