"""P/D between workers of different tensor-parallel sizes, over real NIXL between real worker
processes: P at TP 2 to D at TP 1 and P at TP 1 to D at TP 2 (and 2 to 2), pulled and pushed.

Each TP-2 worker's rank 1 is a process of its own; rank 0's NIXL agent moves every rank's heads
(common/parallel/kv_shards.py): where the two sides split the heads differently, a pull reads
P's blocks whole into a staging buffer and copies the heads into D's shards, a push gathers
P's heads into D's layout and writes them whole (kv_transfer/nixl/staging.py).
Every answer equals what a TP-1 worker computes alone, came from the transferred KV (no
recompute), and every block comes back on both sides. A mismatch the transfer cannot bridge
(another block size) is refused at handshake, naming both sides.
"""

from __future__ import annotations

import httpx
import pytest

from tests.servers import kv_sources, wait_until
from tests.test_pd_pull import complete, descriptors, prefill, prompts
from tests.test_pd_push import reserve

PAIRS = {"p2-d1": ("p2", "d1"), "p1-d2": ("p1", "d2"), "p2-d2": ("p2", "d2")}
# one block to three, full and partial last blocks, mixed: a shorter prompt after longer ones
# takes the smaller of two free staging buffers
ORDER = [0, 4, 1, 7, 2, 5, 3, 6]  # lengths 3, 17, 9, 33, 15, 24, 16, 31
NUM_PROMPTS = len(ORDER)


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    """Two prefill and two decode workers of the tiny Llama (2 KV heads: one per rank at TP 2),
    at TP 1 and 2, with no prefix cache (every block is transferred)."""
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "128", "--max-model-len", "256"]
    common += ["--no-prefix-caching", "--kv-checksum"]
    servers = {  # side by side
        "p1": start_server("prefill", *common, wait=False),
        "p2": start_server("prefill", *common, "-tp", "2", wait=False),
        "d1": start_server("decode", *common, wait=False),
        "d2": start_server("decode", *common, "-tp", "2", wait=False),
    }
    return {name: server.wait_ready() for name, server in servers.items()}


def alone(d1, body: dict) -> list[int]:
    """The answer of a TP-1 worker serving the request alone: the reference."""
    return complete(d1.url, body)["choices"][0]["token_ids"]


def bodies() -> list[dict]:
    return [
        dict(prompt=prompt, max_tokens=10, ignore_eos=True, return_token_ids=True, temperature=0)
        for prompt in (prompts()[i] for i in ORDER)
    ]


def all_blocks_free(*servers) -> bool:
    return all(wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0) for s in servers)


def moved_whole_and_used(p, d, mode: str, before: dict, mover, descs_before) -> None:
    """Every answer decoded from P's KV (checksums over every head matched), none recomputed;
    the KV moved as whole blocks, shard by shard (staged where P and D split the heads
    otherwise): per layer K and V of one run, per shard, ≤ 2 shards; every block back."""
    assert wait_until(lambda: kv_sources(d)[mode] - before[mode] == NUM_PROMPTS)
    assert kv_sources(d)["recomputed"] == before["recomputed"]
    op = "read" if mode == "pull" else "write"
    count, total = (a - b for a, b in zip(descriptors(mover, op), descs_before, strict=True))
    assert count == NUM_PROMPTS
    assert total / count <= 2 * 2
    assert all_blocks_free(p, d)


@pytest.mark.parametrize("pair", PAIRS)
def test_pull_between_tp_sizes_equals_tp1_alone(workers, pair):
    p, d = (workers[name] for name in PAIRS[pair])
    before = kv_sources(d)
    reads_before = descriptors(d, "read")
    for body in bodies():
        params = prefill(p, body)
        pulled = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
        assert pulled["token_ids"] == alone(workers["d1"], body), f"{len(body['prompt'])} tokens"
    moved_whole_and_used(p, d, "pull", before, d, reads_before)


@pytest.mark.parametrize("pair", PAIRS)
def test_push_between_tp_sizes_equals_tp1_alone(workers, pair):
    p, d = (workers[name] for name in PAIRS[pair])
    before = kv_sources(d)
    writes_before = descriptors(p, "write")
    for body in bodies():
        target = reserve(d, len(body["prompt"]))
        push = {"do_remote_decode": True, "push_to": target}
        answer = complete(p.url, {**body, "max_tokens": 1, "kv_transfer_params": push})
        params = answer["kv_transfer_params"]
        assert params["push_reservation_id"] == target["reservation_id"]
        pushed = complete(d.url, {**body, "kv_transfer_params": params})["choices"][0]
        assert pushed["token_ids"] == alone(workers["d1"], body), f"{len(body['prompt'])} tokens"
    moved_whole_and_used(p, d, "push", before, p, writes_before)


def test_a_block_size_the_transfer_cannot_bridge_is_refused_naming_both(
    start_server, tiny_model, workers
):
    args = ["--model", str(tiny_model("llama")), "--num-blocks", "64", "--max-model-len", "256"]
    # D refuses before it reads, so it never releases P's lease: P's blocks come back when the
    # lease runs out, here in 5 s rather than the default minute
    p = start_server("prefill", *args, "-tp", "2", "--block-size", "32", "--kv-lease-timeout", "5")
    body = bodies()[3]
    params = prefill(p, body)
    d = workers["d2"]
    r = httpx.post(
        f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "block_size: 32 there, 16 here" in error["message"], error
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0, timeout=60)
    assert all_blocks_free(d)
