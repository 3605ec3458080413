"""Push-mode (layer-wise) P/D between real worker processes over real NIXL: D reserves blocks,
P WRITEs each layer into them as it computes (chunked prefill included), D decodes once every
layer has landed. Output equals colocated; reservations and blocks come back."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import kv_sources, wait_until
from tests.test_pd_pull import complete, descriptors, prompts


@pytest.fixture(scope="module")
def pd(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "256", "--max-model-len", "256"]
    # P prefills in chunks of 32 tokens: long prompts are pushed over several steps. D's
    # colocated reference chunks the same way, so both compute the prompt identically.
    chunks = ["--max-num-batched-tokens", "32", "--no-prefix-caching"]
    # both compiled: the decorator runs inside the attention op of the compiled graph, P's
    # per-layer WRITEs and D's loads included (the pull tests run eager workers)
    compiled = "--no-enforce-eager"
    p = start_server("prefill", *common, *chunks, compiled)
    d = start_server("decode", *common, *chunks, compiled, "--kv-lease-timeout", "2")
    for worker in (p, d):
        assert worker.metric("pdserve_model_compile_seconds") > 0, worker.log()
        kernels = httpx.get(f"{worker.url}/health", timeout=5).json()["kernels"]
        assert any(k.startswith("decode_attention [") for k in kernels), kernels  # what decodes
        for name, path in kernels.items():  # the same choices as a metric, one sample each
            kernel, shape = name.removesuffix("]").split(" [")
            sample = f'pdserve_kernel_path{{kernel="{kernel}",path="{path}",shape="{shape}"}}'
            assert worker.metric(sample) == 1, sample
    return p, d


def reserve(d, num_tokens: int) -> dict:
    r = httpx.post(f"{d.url}/internal/kv/reserve", json={"num_tokens": num_tokens})
    assert r.status_code == 200, r.text
    target = r.json()
    assert len(target["block_ids"]) == -(-num_tokens // 16)
    return target


# seeded, and the stats behind these metrics: tests/test_pd_inprocess.py (no wire needed)
@pytest.mark.parametrize("mode", ["greedy"])
def test_push_equals_colocated(pd, mode):
    p, d = pd
    sampling = dict(temperature=0) if mode == "greedy" else dict(temperature=0.9, seed=11)
    before = kv_sources(d)
    writes_before = descriptors(p, "write")
    for prompt in prompts():
        body = dict(
            prompt=prompt, max_tokens=10, ignore_eos=True, return_token_ids=True, **sampling
        )
        colocated = complete(d.url, body)["choices"][0]["token_ids"]
        target = reserve(d, len(prompt))
        answer = complete(
            p.url,
            {
                **body,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "push_to": target},
            },
        )
        params = answer["kv_transfer_params"]
        assert params["push_reservation_id"] == target["reservation_id"]
        pushed = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
        assert pushed["token_ids"] == colocated, f"prompt of {len(prompt)} tokens"
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
    # every answer came from the pushed KV, none was recomputed
    assert wait_until(lambda: kv_sources(d)["push"] - before["push"] == len(prompts()))
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    # every chunk's WRITE of a layer was one run on both sides: 2 descriptors, K and V
    grown = lambda: [now - then for now, then in zip(descriptors(p, "write"), writes_before)]  # noqa: E731
    assert wait_until(lambda: grown()[0] == len(prompts()))
    assert grown()[1] == 2 * len(prompts())


def test_unclaimed_reservation_expires_and_release_route(pd):
    _, d = pd
    target = reserve(d, 40)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 3)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0, timeout=10)
    target = reserve(d, 20)
    r = httpx.post(
        f"{d.url}/internal/kv/release", json={"reservation_id": target["reservation_id"]}
    )
    assert r.json() == {"released": True}
    # nothing was pushed: a P might still write, so the blocks come back when it expires
    assert d.metric("pdserve_kv_blocks_used") == 2
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0, timeout=10)


def test_push_that_never_lands_is_recomputed(pd):
    p, d = pd
    body = dict(
        prompt=prompts()[6], max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True
    )
    colocated = complete(d.url, body)["choices"][0]["token_ids"]
    target = reserve(d, len(body["prompt"]))
    # a decode request naming the reservation, but P never pushes: the reservation expires
    params = {
        "do_remote_prefill": True,
        "push_reservation_id": target["reservation_id"],
        "remote_engine_id": "nobody",
        "remote_block_ids": [],
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
    }
    recomputed = 'pdserve_kv_recomputed_total{reason="push_incomplete"}'
    before = d.metric(recomputed)
    out = complete(d.url, {**body, "kv_transfer_params": params})
    assert out["choices"][0]["token_ids"] == colocated
    assert wait_until(lambda: d.metric(recomputed) == before + 1)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
