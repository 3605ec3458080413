"""`--kv-checksum`: D verifies the KV it received against P's per-layer block checksums before
decoding. Real workers over real NIXL: matching KV decodes as colocated; KV that changed after P
handed it over (blocks reused once a lease expired) fails closed — an error, or a recompute that
gives the colocated output — never HTTP 200 with tokens from someone else's KV. Here over real
workers: the error and the metrics; the rest in-process (tests/test_pd_inprocess.py)."""

from __future__ import annotations

import httpx
import pytest
import torch

from common.kv_transfer.nixl.checksum import block_checksums, mismatch, request_checksums
from tests.servers import kv_sources, wait_until
from tests.test_pd_pull import complete, prefill, prompts


def test_block_checksums_see_every_changed_block():
    cache = torch.randn(2, 8, 4, 2, 3)  # (2, blocks, block_size, kv heads, head dim)
    before = block_checksums(cache, [1, 4, 6])
    assert len(before) == 3 and before == block_checksums(cache.clone(), [1, 4, 6])
    cache[1, 4, 3, 1, 2] += 1e-6  # one V element of block 4, one ulp-ish change
    after = block_checksums(cache, [1, 4, 6])
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    assert mismatch(cache, [1, 4, 6], before, layer=7) == "KV checksum mismatch in layer 7 " \
        "(block #1 of 3)"  # fmt: skip
    assert mismatch(cache, [1, 4, 6], after, layer=7) is None
    halves = torch.randn(2, 4, 4, 2, 3).to(torch.bfloat16)
    assert len(request_checksums([halves, halves], [0, 3])) == 2


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


def start_pair(start_server, model, policy: str, lease: str = "30"):
    common = ["--model", model, "--max-model-len", "256", "--no-prefix-caching", "--kv-checksum"]
    # a small pool on P: once a lease expires, the next prompt reuses the same blocks
    p = start_server("prefill", *common, "--num-blocks", "17", "--kv-lease-timeout", lease)
    d = start_server("decode", *common, "--num-blocks", "64", "--kv-load-failure-policy", policy)
    return p, d


# recompute, and matching KV decoding as colocated: tests/test_pd_inprocess.py
@pytest.mark.parametrize("policy", ["fail"])
def test_kv_reused_after_lease_expiry_fails_closed(start_server, model, policy):
    p, d = start_pair(start_server, model, policy, lease="1")
    victim = dict(prompt=prompts()[-2], max_tokens=6, temperature=0, return_token_ids=True)
    params = prefill(p, victim)
    # without the lease's deadline (a peer that sends none) D reads past it: the checksum is
    # what catches the reused blocks (tests/chaos/test_lease_faults.py covers the deadline)
    del params["read_by"]
    assert wait_until(lambda: p.metric("pdserve_kv_lease_expiries_total") == 1, timeout=10)
    other = dict(prompt=prompts()[-1][::-1], max_tokens=1, temperature=0)
    complete(p.url, other)  # its prompt overwrites the freed blocks
    r = httpx.post(
        f"{d.url}/v1/completions", json={**victim, "kv_transfer_params": params}, timeout=60
    )
    if policy == "fail":
        assert r.status_code == 500, r.text
        assert "checksum mismatch" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200
        expected = complete(d.url, victim)["choices"][0]["token_ids"]
        assert r.json()["choices"][0]["token_ids"] == expected
        recomputed = 'pdserve_kv_recomputed_total{reason="checksum_mismatch"}'
        assert wait_until(lambda: d.metric(recomputed) == 1)
    assert wait_until(lambda: d.metric("pdserve_kv_checksum_failures_total") == 1)
    assert kv_sources(d)["pull"] == 0
    for s in (p, d):
        assert wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0), s.url
