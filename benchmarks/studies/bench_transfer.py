"""KV transfer over NIXL: the raw transport vs a memory copy, P→D TTFT (pull and push) vs
colocated, and how much of the transfer each mode exposes.

1. Raw transport, in this process and before any server starts (benchmarks/studies/transfer_raw.py):
a
   request's READ of every layer vs the transport's ceiling and `dst.copy_(src)`, same bytes.
2. End to end over HTTP: `python -m prefill_server` (P) and `python -m decode_server` (D, no
   prefix cache, so every block is read). Pull: P answers a max_tokens=1 request with
   kv_transfer_params; D gets the same body plus those params, streamed. Colocated: D alone,
   streamed, no kv params. Every request has a fresh random prompt; one warm-up per length.
   D's /metrics counters give each load's bytes and seconds (from the first READ issued to the
   end of the forward that waited for it). Exposed transfer: D's first chunk minus P's answer
   (D's HTTP round trip, the reads and one decode step). Push: reserve on D, P prefills with the
   reservation and WRITEs each layer as it computes, then D decodes; its exposed time is the same
   difference with nothing left to read. Medians of `--repeats`.

    python benchmarks/studies/bench_transfer.py [--prompt-lens 512 2048] [--repeats 3]
        [--raw-repeats 30]
                                        [--raw-only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # before nixl is imported

from benchmarks.studies.transfer_raw import BLOCK_SIZE, NUM_BLOCKS, bench_raw, print_raw, print_row  # noqa: E402
from deploy.processes import ServerProcess  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 100, 49152
SERVER_ARGS = ["--max-model-len", "4096", "--num-blocks", str(NUM_BLOCKS), "--log-level", "warning"]
SERVER_ARGS += ["--dtype", "float32", "--enforce-eager"]  # fp32 KV as above; no compile wait
D_MAX_TOKENS = 4  # P's first token + a few decoded by D


# -- 2. end to end over HTTP (1., the raw transport: transfer_raw.py) ---------------------------
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
        print_row([r.prompt_len, f"{colocated * 1e3:.0f}", *ms, ratio, *load, f"{gbps:.2f}", *size])
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
        print_row([r.prompt_len, *(f"{c * 1e3:.0f}" for c in cells), f"{exposed / push_s:.2f}"])


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
