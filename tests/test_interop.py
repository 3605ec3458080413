"""vLLM's front doors drive these workers unchanged: the Rust `vllm-router` (PyPI, its own venv,
`--vllm-pd-disaggregation`) and a client following vLLM's toy-proxy protocol (P with
`do_remote_decode`, `max_tokens` 1, not streamed; then D with P's `kv_transfer_params`), in front
of real P and D workers over real NIXL. Chat and completions, streamed and not: the answer equals
the colocated one, D decoded from the transferred KV (none recomputed), both pools end all-free.

vllm-router's `kv_aware` policy in front of two colocated workers that publish KV events: it
reads their events and each prompt's token ids from their render endpoints, and sends requests
that share a cached prefix to the worker that holds it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from benchmarks.peers.vllm_cpu import ROUTER_VERSION, ensure_router
from tests.servers import free_port, kv_sources, wait_until
from tests.tiny_models import VOCAB

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def pd(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "256", "--max-model-len", "256"]
    common += ["--served-model-name", "tiny"]
    p = start_server("prefill", *common, "--no-prefix-caching", wait=False)
    d = start_server("decode", *common, "--no-prefix-caching", wait=False)
    p, d = p.wait_ready(), d.wait_ready()  # started side by side
    return p, d


@pytest.fixture(scope="module")
def router(pd, tmp_path_factory):
    """vllm-router in P/D mode over our two workers; its URL."""
    p, d = pd
    args = ["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with run_router([*args, "--policy", "round_robin"], log_path) as (url, _):
        yield url


@contextmanager
def run_router(args: list[str], log_path: Path) -> Iterator[tuple[str, str]]:
    """vllm-router with `args` on free ports, its output in `log_path`: (its URL, the URL of its
    Prometheus metrics)."""
    port, metrics_port = free_port(), free_port()
    cmd = [str(ensure_router(ROUTER_VERSION)), *args, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_until(lambda: _is_up(url), timeout=60), log_path.read_text()[-3000:]
            yield url, f"http://127.0.0.1:{metrics_port}/metrics"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def body_for(path: str, i: int, stream: bool) -> dict:
    words = " ".join(f"word{(i * 7 + k) % 50}" for k in range(20 + 9 * i))
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    return {**body, "stream": stream}


def answer(base: str, path: str, body: dict) -> str:
    """The generated text, whole or from the stream's chunks."""
    key = "message" if path == CHAT else None
    if not body["stream"]:
        r = httpx.post(f"{base}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice[key]["content"] if key else choice["text"]
    text = ""
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += (
                        choice.get("delta", {}).get("content") if key else choice["text"]
                    ) or ""
    return text


def toy_proxy(p_url: str, d_url: str, path: str, body: dict) -> str:
    """vLLM's toy-proxy protocol: P prefills (remote decode, one token, not streamed), then D
    continues with P's kv_transfer_params, streamed or not as the client asked."""
    to_p = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }}  # fmt: skip
    to_p.pop("stream_options", None)
    if path == CHAT:
        to_p["max_completion_tokens"] = 1
    r = httpx.post(f"{p_url}{path}", json=to_p, timeout=120)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"], params
    return answer(d_url, path, {**body, "kv_transfer_params": params})


@pytest.mark.parametrize("front", ["vllm-router", "toy-proxy"])
def test_vllm_front_doors_drive_our_workers(request, pd, front):
    p, d = pd
    before = kv_sources(d)
    cases = [(path, stream) for path in (COMPLETIONS, CHAT) for stream in (False, True)]
    for i, (path, stream) in enumerate(cases):
        body = body_for(path, i, stream)
        colocated = answer(d.url, path, body)
        if front == "vllm-router":
            got = answer(request.getfixturevalue("router"), path, body)
        else:
            got = toy_proxy(p.url, d.url, path, body)
        assert got == colocated and got, (front, path, stream)
    # every answer came from KV that P computed and D read over NIXL
    assert wait_until(lambda: kv_sources(d)["pull"] - before["pull"] == len(cases))
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    for worker in (p, d):
        assert wait_until(lambda w=worker: w.metric("pdserve_kv_blocks_used") == 0)


# vllm-router's kv_aware policy over two colocated workers that publish KV events (docs/interop.md)
BLOCK_SIZE = 16
NUM_ROUTED = 6  # requests per prefix through the router
# long shared prefixes: a prompt of 296 tokens (18 full blocks); a chat of ~240 tokens whose
# system prompt fills 14 blocks
PREFIX_A = " ".join(f"alpha{k % 37}" for k in range(45))
PREFIX_B = " ".join(f"beta{k % 41}" for k in range(45))
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def kv_workers(start_server, tiny_model):
    """Two colocated decode workers publishing KV events: [(worker, events port, replay port)]."""
    workers = []
    for _ in range(2):
        events, replay = free_port(), free_port()
        args = ["--model", str(tiny_model("llama")), "--served-model-name", "tiny"]
        args += ["--kv-connector", "none", "--num-blocks", "256", "--max-model-len", "512"]
        args += ["--block-size", str(BLOCK_SIZE), "--kv-events-endpoint", f"tcp://*:{events}"]
        args += ["--kv-events-replay-endpoint", f"tcp://*:{replay}"]
        workers.append((start_server("decode", *args), events, replay))
    return workers


def test_kv_aware_router_routes_by_our_kv_events(kv_workers, tmp_path):
    """vllm-router's kv_aware policy reads our KV events, and each prompt's token ids from our
    render endpoints: requests that share a long prefix go to the worker that has it cached (a
    completion's prompt cached on one worker, a chat's system prompt on the other)."""
    (a, _, _), (b, _, _) = kv_workers
    args = ["--worker-urls", a.url, b.url, "--policy", "kv_aware", "--log-level", "debug"]
    args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "tiny"]
    for worker, events, replay in kv_workers:
        args += ["--kv-event-source", f"{worker.url}=tcp://127.0.0.1:{events}"]
        args += ["--kv-event-replay-source", f"{worker.url}=tcp://127.0.0.1:{replay}"]
    log_path = tmp_path / "router.log"
    with run_router(args, log_path) as (url, router_metrics):
        post(a.url, COMPLETIONS, prefix_body(COMPLETIONS, 0))  # each worker's first KV events
        post(b.url, CHAT, prefix_body(CHAT, 0))
        nudges = iter(range(100, VOCAB, BLOCK_SIZE + 1))
        for worker in (a, b):
            assert wait_until(lambda w=worker: ingested(log_path, w, nudges), 30, 0.5), worker.url
        by_url = {a.url: a, b.url: b}
        before = {(u, p): served(w, p) for u, w in by_url.items() for p in (COMPLETIONS, CHAT)}
        for path in (COMPLETIONS, CHAT):
            for i in range(1, NUM_ROUTED + 1):
                post(url, path, prefix_body(path, i))
        got = {(u, p): served(by_url[u], p) - n for (u, p), n in before.items()}
        decisions = [line for line in logged(log_path) if "KV prefix decision" in line]
        assert got[a.url, COMPLETIONS] >= NUM_ROUTED - 1, (got, decisions)
        assert got[b.url, CHAT] >= NUM_ROUTED - 1, (got, decisions)
        # the router had every prompt's tokens, from our render endpoints
        assert not any("missing_tokens" in line for line in decisions), decisions
        rendered = httpx.get(router_metrics, timeout=5).text
        assert 'vllm_router_kv_routing_inputs_total{transport="http",result="render"}' in rendered
    for path in (COMPLETIONS, CHAT):
        assert sum(served(w, f"{path}/render") for w in (a, b)) >= NUM_ROUTED


def prefix_body(path: str, i: int) -> dict:
    body = {"model": "tiny", "max_tokens": 1}
    if path == CHAT:
        user = {"role": "user", "content": f"question {i}"}
        return {**body, "messages": [{"role": "system", "content": PREFIX_B}, user]}
    return {**body, "prompt": f"{PREFIX_A} tail{i}"}


def post(base: str, path: str, body: dict) -> None:
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text


def served(worker, path: str) -> float:
    """Requests to `path` that `worker` answered with 200."""
    return worker.metric(
        f'pdserve_requests_total{{endpoint="{path}",role="decode",status="200"}}', 0
    )


def logged(log_path: Path) -> list[str]:
    return ANSI.sub("", log_path.read_text()).splitlines()


def ingested(log_path: Path, worker, nudges: Iterator[int]) -> bool:
    """Whether the router applied `worker`'s first batch of KV events, live or replayed. If not,
    the worker publishes another batch (a new prompt of its own): a subscriber that joined after
    the first one asks for it again when it sees the gap."""
    applied = re.compile(rf"sequence advanced source={re.escape(worker.url)} rank=0 seq=0\b")
    if any(applied.search(line) for line in logged(log_path)):
        return True
    start = next(nudges)
    post(worker.url, COMPLETIONS, {"prompt": list(range(start, start + BLOCK_SIZE + 1))})
    return False
