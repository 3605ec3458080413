"""KV transfer over NIXL: the raw transport vs a memory copy, P→D TTFT (pull and push) vs
colocated, and how much of the transfer each mode exposes.

1. Raw transport, in this process and before any server starts: two NixlTransports over KV
   tensors shaped like SmolLM2's (30 layers of (2, 600, 16, 3, 64) fp32); READ of every layer of
   the contiguous blocks a prompt needs vs `dst.copy_(src)` of the same number of bytes.
2. End to end over HTTP: `python -m prefill_server` (P) and `python -m decode_server` (D, no
   prefix cache, so every block is read). Pull: P answers a max_tokens=1 request with
   kv_transfer_params; D gets the same body plus those params, streamed. Colocated: D alone,
   streamed, no kv params. Every request has a fresh random prompt; one warm-up per length.
   D's /metrics counters give each load's bytes and seconds (from the first READ issued to the
   end of the forward that waited for it). Exposed transfer: D's first chunk minus P's answer
   (D's HTTP round trip, the reads and one decode step). Push: reserve on D, P prefills with the
   reservation and WRITEs each layer as it computes, then D decodes; its exposed time is the same
   difference with nothing left to read. Medians of `--repeats`.

    python benchmarks/bench_transfer.py [--prompt-lens 512 2048] [--repeats 3] [--raw-repeats 30]
                                        [--raw-only]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # before nixl is imported

from deploy.processes import ServerProcess  # noqa: E402

# SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 on CPU; the server's default block size
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
NUM_BLOCKS = 600
VOCAB_LOW, VOCAB_HIGH = 100, 49152
SERVER_ARGS = ["--max-model-len", "4096", "--num-blocks", str(NUM_BLOCKS), "--log-level", "warning"]
SERVER_ARGS += ["--dtype", "float32", "--enforce-eager"]  # fp32 KV as above; no compile wait
D_MAX_TOKENS = 4  # P's first token + a few decoded by D


# -- 1. raw transport ----------------------------------------------------------------------------
@dataclass
class RawRow:
    prompt_len: int
    huge_pages: bool
    num_blocks: int
    descriptors_per_layer: int
    num_bytes: int
    read_s: float  # the request's blocks of every layer in one READ, as a pull does
    per_layer_s: float  # one READ per layer, all submitted at once (push posts this way)
    ceiling_s: float  # one NIXL READ of the same bytes as a single descriptor
    copy_s: float  # torch copy of the same bytes
    post_us: float  # posting one layer's READ: descriptors and handle
    checksum_s: float  # --kv-checksum: one side's sums over every layer of these blocks


def bench_raw(prompt_lens: list[int], repeats: int) -> list[RawRow]:
    from common.kv_transfer.nixl_transport import NixlTransport

    rows = []
    for huge in (True, False):
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        remote_kv = [t.fill_(1.0) for t in _kv_caches(shape, huge)]
        local_kv = _kv_caches(shape, huge)  # touched (zeroed): no page faults
        with NixlTransport("raw-p", remote_kv) as p, NixlTransport("raw-d", local_kv) as d:
            d.add_peer(p.layout, p.metadata())
            for n in prompt_lens:
                rows.append(_raw_row(d, local_kv, n, huge, repeats))
        del remote_kv, local_kv
        gc.collect()
    return rows


def _kv_caches(shape: tuple[int, ...], huge_pages: bool) -> list[torch.Tensor]:
    """As a worker allocates them: huge pages, every layer a view of one mapping (one NIXL
    region); or, as before, one plain torch.zeros a layer (a region each)."""
    if huge_pages:
        return list(_tensor((NUM_LAYERS, *shape), True).unbind(0))
    return [torch.zeros(shape) for _ in range(NUM_LAYERS)]


def _tensor(shape: tuple[int, ...], huge_pages: bool) -> torch.Tensor:
    from common.kv_cache.tensors import huge_page_zeros

    return huge_page_zeros(shape, torch.float32) if huge_pages else torch.zeros(shape)


def _raw_row(d, local_kv, prompt_len: int, huge: bool, repeats: int) -> RawRow:
    from common.kv_transfer.checksum import request_checksums

    num_blocks = math.ceil(prompt_len / BLOCK_SIZE)
    blocks = list(range(1, num_blocks + 1))  # contiguous, as the allocator gives them
    read_all_layers(d, blocks)  # warm-up (the first READ also connects)
    reads = [read_all_layers(d, blocks) for _ in range(repeats)]
    per_layer = [read_each_layer(d, blocks) for _ in range(repeats)]
    num_bytes = reads[0][1]
    src, dst = _tensor((num_bytes // 4,), huge).fill_(1.0), _tensor((num_bytes // 4,), huge)
    ceiling = Ceiling(src, dst)
    ceiling.read()  # warm-up (connects)
    assert torch.equal(src, dst), "the ceiling READ did not land"
    ceilings = [_timed(ceiling.read) for _ in range(repeats)]
    del ceiling  # its agents go before the memory they registered
    dst.copy_(src)  # warm-up
    copies = [_timed(lambda: dst.copy_(src)) for _ in range(repeats)]
    request_checksums(local_kv, blocks)  # warm-up
    sums = [_timed(lambda: request_checksums(local_kv, blocks)) for _ in range(repeats)]
    return RawRow(
        prompt_len,
        huge,
        num_blocks,
        descriptors_per_layer=reads[0][2] // NUM_LAYERS,
        num_bytes=num_bytes,
        read_s=statistics.median(r[0] for r in reads),
        per_layer_s=statistics.median(per_layer),
        ceiling_s=statistics.median(ceilings),
        copy_s=statistics.median(copies),
        post_us=statistics.median(r[3] for r in reads) * 1e6 / NUM_LAYERS,
        checksum_s=statistics.median(sums),
    )


def read_all_layers(d, blocks: list[int]) -> tuple[float, int, int, float]:
    """(seconds, bytes, descriptors, posting seconds) of one READ of every layer."""
    start = time.perf_counter()
    result = d.read_layers("raw-p", range(NUM_LAYERS), blocks, blocks).result(timeout=60)
    elapsed = time.perf_counter() - start
    return elapsed, result.num_bytes, result.num_descriptors, result.post_s


def read_each_layer(d, blocks: list[int]) -> float:
    """Seconds of one READ per layer, all submitted at once."""
    start = time.perf_counter()
    futures = [d.read_layer("raw-p", layer, blocks, blocks) for layer in range(NUM_LAYERS)]
    for future in futures:
        future.result(timeout=60)
    return time.perf_counter() - start


class Ceiling:
    """The transport's ceiling: `src` into `dst` as one descriptor, one NIXL READ, between two
    agents of their own (separate from the transports under test)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        from common.kv_transfer.nixl_agent import create_agent

        self.p, self.d = create_agent("ceiling-p", 1000), create_agent("ceiling-d", 1000)
        self.p.register_memory([src])
        self.d.register_memory([dst])
        self.d.add_remote_agent(self.p.get_agent_metadata())  # after registering: it says where
        nbytes = src.numel() * src.element_size()
        self.local = self.d.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
        self.remote = self.d.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")

    def read(self) -> None:
        handle = self.d.initialize_xfer("READ", self.local, self.remote, "ceiling-p")
        state = self.d.transfer(handle)
        while state != "DONE":
            assert state == "PROC", f"ceiling READ: {state}"
            state = self.d.check_xfer_state(handle)
        self.d.release_xfer_handle(handle)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- 2. end to end over HTTP -------------------------------------------------------------------
@dataclass
class PullSample:
    p_answer_s: float  # P's non-streamed answer (with kv_transfer_params) is in
    d_first_s: float  # D's first streamed chunk (it carries P's first token)
    num_bytes: float  # D's /metrics deltas over the request
    transfer_s: float
    num_descriptors: float

    @property
    def exposed_s(self) -> float:
        return self.d_first_s - self.p_answer_s


@dataclass
class PushSample:
    p_answer_s: float  # P answered: every layer was written into D's reservation
    d_first_s: float
    push_s: float  # P's /metrics: first WRITE to last landed
    push_exposed_s: float  # of that, after P's forward ended

    @property
    def exposed_s(self) -> float:
        return self.d_first_s - self.p_answer_s


@dataclass
class E2ERow:
    prompt_len: int
    colocated: list[float]
    pulls: list[PullSample]
    pushes: list[PushSample]


def bench_e2e(prompt_lens: list[int], repeats: int, model_args: list[str]) -> list[E2ERow]:
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-transfer-")))
        p = _start(stack, "prefill", [*SERVER_ARGS, *model_args], logs)
        d = _start(stack, "decode", [*SERVER_ARGS, *model_args, "--no-prefix-caching"], logs)
        p.wait_ready(300)
        d.wait_ready(300)
        client = stack.enter_context(httpx.Client(timeout=600))
        gen = torch.Generator().manual_seed(0)
        return [_e2e_row(client, p.url, d.url, n, repeats, gen) for n in prompt_lens]


def _start(stack: contextlib.ExitStack, role: str, args: list[str], logs: Path) -> ServerProcess:
    server = ServerProcess(role, args, logs / f"{role}.log")
    stack.callback(server.stop)  # also on exceptions and Ctrl-C
    return server


def _e2e_row(client, p_url, d_url, prompt_len, repeats, gen) -> E2ERow:
    def body() -> dict:
        prompt = torch.randint(VOCAB_LOW, VOCAB_HIGH, (prompt_len,), generator=gen).tolist()
        return dict(
            prompt=prompt,
            max_tokens=D_MAX_TOKENS,
            temperature=0,
            ignore_eos=True,
            return_token_ids=True,
        )

    colocated_ttft(client, d_url, body())  # warm-up
    pull_ttft(client, p_url, d_url, body())
    colocated = [colocated_ttft(client, d_url, body()) for _ in range(repeats)]
    pulls = [pull_ttft(client, p_url, d_url, body()) for _ in range(repeats)]
    push_ttft(client, p_url, d_url, body())  # warm-up (P's handshake with D)
    pushes = [push_ttft(client, p_url, d_url, body()) for _ in range(repeats)]
    return E2ERow(prompt_len, colocated, pulls, pushes)


def colocated_ttft(client: httpx.Client, d_url: str, body: dict) -> float:
    start = time.perf_counter()
    return first_chunk(client, d_url, body)[0] - start


def pull_ttft(client: httpx.Client, p_url: str, d_url: str, body: dict) -> PullSample:
    before = metrics(client, d_url)
    start = time.perf_counter()
    to_p = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = client.post(f"{p_url}/v1/completions", json=to_p)
    r.raise_for_status()
    p_answer = time.perf_counter()
    params = r.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"], f"P gave no kv_transfer_params: {r.text}"
    d_first, tokens = first_chunk(client, d_url, {**body, "kv_transfer_params": params})
    assert tokens[0] == params["first_token_id"], "D's first chunk is not P's first token"
    after = metrics(client, d_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["pdserve_kv_transfers_total"] == 1, "D did not load the KV from P"
    assert delta["pdserve_kv_transfer_failures_total"] == 0, "D's KV load failed"
    return PullSample(
        p_answer - start,
        d_first - start,
        delta["pdserve_kv_transfer_bytes_total"],
        delta["pdserve_kv_transfer_seconds_total"],
        delta["pdserve_kv_transfer_descriptors_total"],
    )


def push_ttft(client: httpx.Client, p_url: str, d_url: str, body: dict) -> PushSample:
    """Reserve on D, prefill on P with the reservation (layer-wise WRITEs), decode on D."""
    before = metrics(client, p_url)
    start = time.perf_counter()
    r = client.post(f"{d_url}/internal/kv/reserve", json={"num_tokens": len(body["prompt"])})
    r.raise_for_status()
    to_p = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "push_to": r.json()},
    }
    r = client.post(f"{p_url}/v1/completions", json=to_p)
    r.raise_for_status()
    p_answer = time.perf_counter()
    params = r.json()["kv_transfer_params"]
    assert params.get("push_reservation_id"), f"P did not push: {r.text}"
    d_first, tokens = first_chunk(client, d_url, {**body, "kv_transfer_params": params})
    assert tokens[0] == params["first_token_id"], "D's first chunk is not P's first token"
    after = metrics(client, p_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["pdserve_kv_push_failures_total"] == 0, "P's push failed"
    return PushSample(
        p_answer - start,
        d_first - start,
        delta["pdserve_kv_push_seconds_total"],
        delta["pdserve_kv_push_exposed_seconds_total"],
    )


def first_chunk(client: httpx.Client, url: str, body: dict) -> tuple[float, list[int]]:
    """(perf_counter() when the first streamed chunk with a choice arrives, its token ids);
    reads the stream to its end."""
    first = None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices:
                    first = time.perf_counter(), choices[0]["token_ids"]
    assert first is not None, "no chunk with a choice in the stream"
    return first


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    """The unlabelled pdserve_kv_transfer* and pdserve_kv_push* values of /metrics."""
    text = client.get(f"{url}/metrics").text
    pairs = (
        line.split()
        for line in text.splitlines()
        if line.startswith(("pdserve_kv_transfer", "pdserve_kv_push"))
    )
    return {name: float(value) for name, value in pairs}


# -- 3. report ----------------------------------------------------------------------------------
def print_raw(rows: list[RawRow], repeats: int) -> None:
    print(
        f"\n### Raw transport: a request's KV ({NUM_LAYERS} layers) in one READ, and one READ a"
        " layer, vs the transport's ceiling (one descriptor) and a torch copy of the same bytes"
        f" (median of {repeats})\n"
    )
    print(
        "| prompt tokens | KV pages, NIXL regions | blocks | descriptors a layer | MiB | READ GB/s"
        " | per-layer READs GB/s | ceiling GB/s | torch copy GB/s | READ / ceiling (goal ≥ 0.9)"
        " | READ / copy (goal ≥ 0.6) | posting µs a layer | READ ms | checksum ms (one side) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        times = (r.read_s, r.per_layer_s, r.ceiling_s, r.copy_s)
        read, per_layer, ceiling, copy = (r.num_bytes / t / 1e9 for t in times)
        pages = "2 MiB, one region" if r.huge_pages else "4 KiB, a region a layer"
        cells = [r.prompt_len, pages, r.num_blocks]
        cells += [r.descriptors_per_layer, f"{r.num_bytes / 2**20:.1f}"]
        cells += [f"{read:.2f}", f"{per_layer:.2f}", f"{ceiling:.2f}", f"{copy:.2f}"]
        cells += [f"{read / ceiling:.2f}", f"{read / copy:.2f}", f"{r.post_us:.1f}"]
        _print_row([*cells, f"{r.read_s * 1e3:.1f}", f"{r.checksum_s * 1e3:.1f}"])


def print_e2e(rows: list[E2ERow], repeats: int) -> None:
    print(f"\n### End to end over HTTP: P→D pull vs colocated (median of {repeats}, ms)\n")
    print(
        "| prompt tokens | colocated TTFT | P's answer | D's first chunk (pull TTFT)"
        " | pull / colocated | exposed transfer | D's load | load GB/s | MiB | descriptors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        colocated, pull = statistics.median(r.colocated), _median(r.pulls, "d_first_s")
        ms = [f"{_median(r.pulls, k) * 1e3:.0f}" for k in ("p_answer_s", "d_first_s")]
        ratio = f"{pull / colocated:.2f}"
        load = [f"{_median(r.pulls, k) * 1e3:.0f}" for k in ("exposed_s", "transfer_s")]
        gbps = statistics.median(s.num_bytes / s.transfer_s / 1e9 for s in r.pulls)
        mib = _median(r.pulls, "num_bytes") / 2**20
        size = [f"{mib:.1f}", f"{_median(r.pulls, 'num_descriptors'):.0f}"]
        _print_row(
            [r.prompt_len, f"{colocated * 1e3:.0f}", *ms, ratio, *load, f"{gbps:.2f}", *size]
        )
    print(f"\n### Pull vs push over HTTP (median of {repeats}, ms)\n")
    print(
        "| prompt tokens | colocated TTFT | pull TTFT | push TTFT | pull: D's load | push: "
        "WRITEs | push: after P's forward | push exposed / push transfer (goal ≤ 0.2) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        push_s, exposed = _median(r.pushes, "push_s"), _median(r.pushes, "push_exposed_s")
        cells = [
            statistics.median(r.colocated),
            _median(r.pulls, "d_first_s"),
            _median(r.pushes, "d_first_s"),
            _median(r.pulls, "transfer_s"),
            push_s,
            exposed,
        ]
        _print_row([r.prompt_len, *(f"{c * 1e3:.0f}" for c in cells), f"{exposed / push_s:.2f}"])


def _print_row(cells: list) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |")


def _median(samples: list[PullSample], attr: str) -> float:
    return statistics.median(getattr(s, attr) for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3, help="HTTP requests per length")
    parser.add_argument("--raw-repeats", type=int, default=30, help="raw READs per length")
    parser.add_argument("--model", help="HF folder (default: the built-in SmolLM2)")
    parser.add_argument("--raw-only", action="store_true", help="skip the HTTP part")
    a = parser.parse_args()
    if max(a.prompt_lens) >= 4096:
        parser.error("--prompt-lens must be below --max-model-len 4096")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every started server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raw = bench_raw(a.prompt_lens, a.raw_repeats)
    model_args = ["--model", a.model] if a.model else []
    e2e = [] if a.raw_only else bench_e2e(a.prompt_lens, a.repeats, model_args)
    print(f"KV transfer, SmolLM2 (fp32, blocks of {BLOCK_SIZE} tokens), random prompts")
    print_raw(raw, a.raw_repeats)
    if e2e:
        print_e2e(e2e, a.repeats)


if __name__ == "__main__":
    main()
