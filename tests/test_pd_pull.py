"""Pull-mode P/D between real worker processes over real NIXL: output equals colocated, blocks
come back on both sides, leases expire, failures end clearly."""

from __future__ import annotations

import httpx
import pytest
import torch

from common.config import ModelConfig
from tests.servers import complete, kv_sources, wait_until
from tests.tiny_models import VOCAB

LENGTHS = [3, 9, 15, 16, 17, 24, 31, 33, 40, 47, 50, 63, 64, 65, 80, 97, 120, 130, 150, 170]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def pd(start_server, model):
    common = ["--model", model, "--num-blocks", "256", "--max-model-len", "256"]
    # NOTE: bitwise-equal output needs both sides to compute the prompt the same way; a prefix
    # hit takes another attention path, whose fp32 noise (~1e-6) can flip a seeded draw
    p = start_server(
        "prefill", *common, "--kv-lease-timeout", "30", "--no-prefix-caching", wait=False
    )
    # no prefix cache on D: every block of every prompt is read from P, none served locally
    d = start_server(
        "decode", *common, "--kv-load-timeout", "10", "--no-prefix-caching", wait=False
    )
    return p.wait_ready(), d.wait_ready()  # started side by side


def prefill(p, body: dict) -> dict:
    out = complete(
        p.url,
        {
            **body,
            "max_tokens": 1,
            "stream": False,
            "return_token_ids": True,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    assert params["first_token_id"] == out["choices"][0]["token_ids"][0]
    return params


# seeded, and the stats behind these metrics: tests/test_pd_inprocess.py (no wire needed)
@pytest.mark.parametrize("mode", ["greedy"])
def test_pull_equals_colocated(pd, mode):
    p, d = pd
    sampling = dict(temperature=0) if mode == "greedy" else dict(temperature=0.9, seed=7)
    before = kv_sources(d)
    reads_before = descriptors(d, "read")
    for i, prompt in enumerate(prompts()):
        body = dict(
            prompt=prompt, max_tokens=12, ignore_eos=True, return_token_ids=True, **sampling
        )
        colocated = complete(d.url, body)["choices"][0]["token_ids"]
        params = prefill(p, body)
        if i % 2:  # vLLM-style: no first token, D recomputes the last prompt token
            params = {k: v for k, v in params.items() if k != "first_token_id"}
        pulled = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
        assert pulled["token_ids"] == colocated, f"prompt of {len(prompt)} tokens"
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
    # every answer came from the transferred KV, none was recomputed
    assert wait_until(lambda: kv_sources(d)["pull"] - before["pull"] == len(prompts()))
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    # one READ each, its blocks one run on both sides (idle pools allocate contiguously): 2
    # descriptors a layer, K and V, whatever the prompt's length
    grown = lambda: [now - then for now, then in zip(descriptors(d, "read"), reads_before)]  # noqa: E731
    assert wait_until(lambda: grown()[0] == len(prompts()))
    assert grown()[1] == 2 * len(prompts())


def descriptors(worker, op: str) -> tuple[float, float]:
    """(count, sum) of the worker's `pdserve_kv_descriptors` histogram for `op`."""
    name = "pdserve_kv_descriptors"
    return worker.metric(f'{name}_count{{op="{op}"}}'), worker.metric(f'{name}_sum{{op="{op}"}}')


def test_release_route_and_lease_expiry(start_server, model):
    p = start_server(
        "prefill",
        "--model",
        model,
        "--num-blocks",
        "64",
        "--max-model-len",
        "256",
        "--kv-lease-timeout",
        "1.5",
    )
    body = dict(prompt=prompts()[12], temperature=0)
    held = prefill(p, body)
    num_held = len(held["remote_block_ids"])
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == num_held)
    r = httpx.post(f"{p.url}/internal/kv/release", json={"request_id": held["remote_request_id"]})
    assert r.json() == {"released": True}
    # NOTE: the engine refreshes its stats after the release answers: wait, do not read once
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)
    prefill(p, body)  # nobody reads it: the lease expires
    assert p.metric("pdserve_kv_blocks_used") > 0
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0, timeout=10)
    assert p.metric("pdserve_kv_lease_expiries_total") == 1


def test_incompatible_prefill_is_refused(start_server, model, pd):
    _, d = pd
    p32 = start_server(
        "prefill",
        "--model",
        model,
        "--num-blocks",
        "64",
        "--max-model-len",
        "256",
        "--block-size",
        "32",
    )
    body = dict(prompt=prompts()[5], temperature=0, max_tokens=4)
    params = prefill(p32, body)
    r = httpx.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params"
    assert "block_size: 32 there, 16 here" in err["message"]
    httpx.post(f"{p32.url}/internal/kv/release", json={"request_id": params["remote_request_id"]})
    assert wait_until(lambda: p32.metric("pdserve_kv_blocks_used") == 0)


@pytest.mark.parametrize("p_dtype", ["auto", "bfloat16"])
def test_dtype_mismatch_is_refused(start_server, model, pd, p_dtype):
    """D runs explicit float32 (tests/servers.py); a P in bf16, asked for by name or by auto
    where auto means bf16 here, is refused by the handshake."""
    _, d = pd
    if ModelConfig(dtype=p_dtype).torch_dtype == torch.float32:
        pytest.skip("--dtype auto is float32 on this CPU: it matches D")
    common = ["--model", model, "--num-blocks", "64", "--max-model-len", "256"]
    p16 = start_server("prefill", *common, "--dtype", p_dtype)
    body = dict(prompt=prompts()[5], temperature=0, max_tokens=4)
    params = prefill(p16, body)
    r = httpx.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params"
    assert "dtype: 'torch.bfloat16' there, 'torch.float32' here" in err["message"]
    httpx.post(f"{p16.url}/internal/kv/release", json={"request_id": params["remote_request_id"]})
    assert wait_until(lambda: p16.metric("pdserve_kv_blocks_used") == 0)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_read(start_server, model, policy):
    common = ["--model", model, "--num-blocks", "128", "--max-model-len", "256"]
    p = start_server("prefill", *common, wait=False)
    d = start_server(
        "decode", *common, "--kv-load-timeout", "3", "--kv-load-failure-policy", policy, wait=False
    )
    p, d = p.wait_ready(), d.wait_ready()  # started side by side
    body = dict(
        prompt=prompts()[15], temperature=0, max_tokens=8, ignore_eos=True, return_token_ids=True
    )
    colocated = complete(d.url, body)["choices"][0]["token_ids"]
    # D knows P (handshake done), then P dies before D reads
    warm = prefill(p, body)
    complete(d.url, {**body, "kv_transfer_params": warm})
    params = prefill(p, body)
    p.proc.kill()
    p.proc.wait()
    r = httpx.post(
        f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=30
    )
    if policy == "recompute":
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated
        recomputed = 'pdserve_kv_recomputed_total{reason="read_failed"}'
        assert wait_until(lambda: d.metric(recomputed) == 1)
    else:
        assert r.status_code == 500 and "did not arrive" in r.json()["error"]["message"]
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)


def test_client_abort_after_the_transfer_frees_both_pools(pd):
    p, d = pd
    body = dict(prompt=prompts()[17], temperature=0, ignore_eos=True)
    params = prefill(p, body)
    stream = {**body, "max_tokens": 100, "stream": True, "kv_transfer_params": params}
    with httpx.stream("POST", f"{d.url}/v1/completions", json=stream, timeout=30) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(4))
    # the read finished before the first token: P's lease is released, D aborts on disconnect
    assert wait_until(lambda: d.metric("pdserve_num_requests_running") == 0)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)


def test_decode_reads_only_the_blocks_it_lacks(start_server, model, pd):
    p, _ = pd
    d = start_server("decode", "--model", model, "--num-blocks", "256", "--max-model-len", "256")
    shared = prompts()[19][:64]  # four full blocks D will have cached
    body = dict(
        prompt=shared + prompts()[18][:40],
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        return_token_ids=True,
    )
    complete(d.url, dict(prompt=shared + [7, 7], max_tokens=1))  # D caches the shared blocks
    colocated = complete(d.url, body)["choices"][0]["token_ids"]
    block_bytes = 2 * 16 * 2 * 16 * 4 * 3  # K+V x block x kv heads x head dim x fp32 x layers

    def loaded() -> float:
        return d.metric("pdserve_kv_transfer_bytes_total")

    before = loaded()
    params = prefill(p, body)
    out = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
    assert out["token_ids"] == colocated
    # 104 prompt tokens = 7 blocks; 6 are cached (4 shared + 2 from the colocated run): 1 read
    assert loaded() - before == 1 * block_bytes
    # a full hit (a 96-token prompt whose 6 blocks D has) reads nothing and still releases P
    body = {**body, "prompt": body["prompt"][:96]}
    colocated = complete(d.url, body)["choices"][0]["token_ids"]
    before = loaded()
    out = complete(d.url, {**body, "kv_transfer_params": prefill(p, body)})["choices"][0]
    assert out["token_ids"] == colocated and loaded() == before
    assert d.metric("pdserve_kv_transfers_total") == 2
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)
