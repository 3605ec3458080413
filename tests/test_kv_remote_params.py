"""D checks P's `kv_transfer_params` before it reads (common/kv_transfer/params.py), with real
workers over real NIXL:

- a field of the wrong type or out of range is a 400 naming `kv_transfer_params`;
- a block list of another length than the prompt's blocks, block ids past P's pool, checksums
  of another shape are a failed transfer under `--kv-load-failure-policy`: an error in
  OpenAI's shape, or a recompute counted as `remote_blocks_mismatch` that answers as colocated;
  never a 200 decoded over blocks that nobody wrote; pushed, checksums of another shape are a
  mismatch (by the same policy). Every block comes back on both sides.
"""

from __future__ import annotations

import httpx
import pytest

from tests.servers import kv_sources, wait_until
from tests.test_pd_pull import complete, prefill, prompts
from tests.test_pd_push import reserve
from tests.tiny_models import VOCAB

P_BLOCKS = 64
RECOMPUTED = 'pdserve_kv_recomputed_total{reason="remote_blocks_mismatch"}'


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--max-model-len", "256"]
    common += ["--num-blocks", str(P_BLOCKS), "--no-prefix-caching", "--kv-checksum"]
    p = start_server("prefill", *common, "--kv-lease-timeout", "30")
    policies = {
        policy: start_server("decode", *common, "--kv-load-failure-policy", policy)
        for policy in ("fail", "recompute")
    }
    return p, policies


def unused(ids: list[int]) -> int:
    return next(b for b in range(P_BLOCKS) if b not in ids)


CUTS = ["short", "long", "past_the_pool", "checksums_a_layer_short", "checksums_a_block_short"]


def cut(params: dict, how: str) -> dict:
    """P's params with one field changed as `how` says."""
    ids, sums = params["remote_block_ids"], params["kv_checksums"]
    changed = {
        "short": {"remote_block_ids": ids[:1]},
        "long": {"remote_block_ids": [*ids, unused(ids)]},
        "past_the_pool": {"remote_block_ids": [*ids[:-1], 10**6]},
        "checksums_a_layer_short": {"kv_checksums": sums[:-1]},
        "checksums_a_block_short": {"kv_checksums": [c[:-1] for c in sums]},
    }
    return {**params, **changed[how]}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("how", CUTS)
def test_params_that_do_not_fit_the_prompt_fail_closed(workers, how, policy):
    p, decoders = workers
    d = decoders[policy]
    body = dict(prompt=prompts()[15], max_tokens=6, temperature=0, return_token_ids=True)
    params = prefill(p, body)  # 97 tokens: 7 blocks of 16
    assert len(params["remote_block_ids"]) == 7
    before, recomputed = kv_sources(d), d.metric(RECOMPUTED)
    r = httpx.post(
        f"{d.url}/v1/completions",
        json={**body, "kv_transfer_params": cut(params, how)},
        timeout=60,
    )
    if policy == "fail":
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert "did not arrive" in error["message"] and error["type"], error
        assert any(field in error["message"] for field in ("remote_block_ids", "kv_checksums"))
    else:
        assert r.status_code == 200, r.text
        colocated = complete(d.url, body)["choices"][0]["token_ids"]
        assert r.json()["choices"][0]["token_ids"] == colocated
        assert wait_until(lambda: d.metric(RECOMPUTED) == recomputed + 1)
    assert kv_sources(d)["pull"] == before["pull"]  # nothing decoded from what was read
    for server in (p, d):
        assert wait_until(lambda s=server: s.metric("pdserve_kv_blocks_used") == 0)
    assert httpx.get(f"{d.url}/health", timeout=5).status_code == 200


SYNTHETIC = {  # no prefill behind it: refused before any handshake or read
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_block_ids": [0, 1],
    "remote_request_id": "r",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "first_token_id": 5,
}
MALFORMED = {
    "float_block_id": {"remote_block_ids": [0, 1.5]},
    "string_block_id": {"remote_block_ids": ["0", "1"]},
    "negative_block_id": {"remote_block_ids": [0, -1]},
    "repeated_block_id": {"remote_block_ids": [1, 1]},
    "block_ids_not_a_list": {"remote_block_ids": "0,1"},
    "port_string": {"remote_port": "8000"},
    "port_out_of_range": {"remote_port": 70000},
    "engine_id_not_text": {"remote_engine_id": {"id": "p"}},
    "streamed_as_string": {"first_token_streamed": "false"},
    "negative_first_token": {"first_token_id": -1},
    "first_token_past_the_vocabulary": {"first_token_id": VOCAB},
    "float_checksum": {"kv_checksums": [[1.0, 2.0]]},
    "read_by_bool": {"read_by": True},
    "tp_size_zero": {"tp_size": 0},
}


@pytest.mark.parametrize("field", MALFORMED)
def test_a_field_of_the_wrong_type_is_a_400(workers, field):
    _, decoders = workers
    d = decoders["recompute"]  # a 400 whatever the policy: nothing is recomputed from it
    params = {**SYNTHETIC, **MALFORMED[field]}
    body = dict(prompt=prompts()[3], max_tokens=2, kv_transfer_params=params)
    r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and "malformed" in error["message"], error


def test_pushed_checksums_of_another_shape_fail_closed(workers):
    """Push mode: checksums for a layer more than D has are a mismatch, never an index past
    D's layers (the engine's thread)."""
    p, decoders = workers
    d = decoders["recompute"]
    body = dict(prompt=prompts()[9], max_tokens=4, temperature=0, return_token_ids=True)
    target = reserve(d, len(body["prompt"]))
    push = {"do_remote_decode": True, "push_to": target}
    params = complete(p.url, {**body, "max_tokens": 1, "kv_transfer_params": push})
    params = params["kv_transfer_params"]
    params["kv_checksums"] = [*params["kv_checksums"], params["kv_checksums"][0]]
    recomputed = 'pdserve_kv_recomputed_total{reason="checksum_mismatch"}'
    before = d.metric(recomputed)
    pushed = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
    assert pushed["token_ids"] == complete(d.url, body)["choices"][0]["token_ids"]
    assert wait_until(lambda: d.metric(recomputed) == before + 1)
    for server in (p, d):
        assert wait_until(lambda s=server: s.metric("pdserve_kv_blocks_used") == 0)


def test_a_first_token_past_the_vocabulary_is_a_400_and_the_engine_lives(workers):
    """P's first token is taken as generated on D: one past the vocabulary would index past the
    embedding on D's engine thread."""
    p, decoders = workers
    d = decoders["fail"]
    body = dict(prompt=prompts()[5], max_tokens=3, temperature=0)
    params = {**prefill(p, body), "first_token_id": VOCAB}
    r = httpx.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert complete(d.url, body)["choices"][0]["text"] is not None  # still serving


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_reservation_smaller_than_the_prompt_fails_closed(workers, policy):
    """Push mode: D's reservation for a short prompt, named with a long prompt: its tail blocks
    were never written, so it is a mismatch by policy, never a 200 decoded over them."""
    p, decoders = workers
    d = decoders[policy]
    short = dict(prompt=prompts()[3], max_tokens=1, temperature=0)
    target = reserve(d, len(short["prompt"]))
    push = {"do_remote_decode": True, "push_to": target}
    params = complete(p.url, {**short, "kv_transfer_params": push})["kv_transfer_params"]
    long = dict(prompt=prompts()[15], max_tokens=6, temperature=0, return_token_ids=True)
    recomputed = d.metric(RECOMPUTED)
    r = httpx.post(f"{d.url}/v1/completions", json={**long, "kv_transfer_params": params})
    if policy == "fail":
        assert r.status_code == 500 and "the prompt needs 7" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200, r.text
        # P's first token is taken as generated, as with any recompute; the rest is computed
        # here over the long prompt and that token
        first, *rest = r.json()["choices"][0]["token_ids"]
        assert first == params["first_token_id"]
        then = {**long, "prompt": [*long["prompt"], first], "max_tokens": 5}
        assert rest == complete(d.url, then)["choices"][0]["token_ids"]
        assert wait_until(lambda: d.metric(RECOMPUTED) == recomputed + 1)
    # D's claimed reservation is freed (P's pool may still hold leases of the 400s above, which
    # D never read: they expire with --kv-lease-timeout)
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
