"""vLLM's front doors drive these workers unchanged: the Rust `vllm-router` (PyPI, its own venv,
`--vllm-pd-disaggregation`) and a client following vLLM's toy-proxy protocol (P with
`do_remote_decode`, `max_tokens` 1, not streamed; then D with P's `kv_transfer_params`), in front
of real P and D workers over real NIXL. Chat and completions, streamed and not: the answer equals
the colocated one, D decoded from the transferred KV (none recomputed), both pools end all-free.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from benchmarks.bench_proxy import ensure_router, free_port
from tests.servers import kv_sources, wait_until

ROUTER_VERSION = "0.1.17"  # as benchmarks/bench_proxy.py measures it
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def pd(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "256", "--max-model-len", "256"]
    common += ["--served-model-name", "tiny"]
    p = start_server("prefill", *common, "--no-prefix-caching")
    d = start_server("decode", *common, "--no-prefix-caching")
    return p, d


@pytest.fixture(scope="module")
def router(pd, tmp_path_factory):
    """vllm-router in P/D mode over our two workers; its URL."""
    p, d = pd
    exe = ensure_router(ROUTER_VERSION)
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    log = log_path.open("w")
    cmd = [str(exe), "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _is_up(url), timeout=60), log_path.read_text()[-3000:]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
