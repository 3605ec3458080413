"""The reverse pull between two engines in this process (the `FakeConnector`'s loopback wire):
a decode worker lends the prompt prefix it holds from an earlier turn (`lease_prefix`), the
prefill worker reads it instead of computing it and computes only the rest, and D then decodes
from its own blocks plus the ones P computed. The HTTP route, the proxy's choice and NIXL
itself: test_proxy_kv_routing.py (`test_the_next_turn_reads_the_answer_it_holds_from_...`).
"""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
from common.engine.engine import LLMEngine
from common.kv_cache.block_pool import NoFreeBlocksError
from common.kv_transfer.fake import FakeConnector, Loopback
from common.kv_transfer.params import KVTransferParamsError, PushTarget
from tests.test_pd_inprocess import connect, run, sampling, settle
from tests.test_pd_inprocess import target as reserve_target
from tests.tiny_models import VOCAB

BLOCK = 16


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def fabric():
    return Loopback()


def make_engine(model: str, fabric: Loopback, prefix_caching: bool = True, **transfer):
    config = EngineConfig(
        ModelConfig(model, max_model_len=256, enforce_eager=True),
        CacheConfig(num_blocks=64, block_size=BLOCK, enable_prefix_caching=prefix_caching),
        transfer=TransferConfig(**transfer),
    )
    return LLMEngine(config, make_connector=lambda *args: FakeConnector(*args, fabric))


@pytest.fixture(scope="module", params=["fail", "recompute"])
def pd(request, model, fabric):
    """P and D, D with checksums for what it lends; P under either failure policy (a prefix
    it cannot read is computed under both)."""
    yield from pair(model, fabric, failure_policy=request.param)


@pytest.fixture(scope="module")
def twins(model, fabric):
    """A second P and D that see the same conversations: what a worker alone (D's twin, from
    its own cache) and today's P/D (P computes the whole prompt) answer. NOTE: the same
    tokens, not merely close ones: D's cached KV of turn 1's answer was computed a token at a
    time, which a prefill of the same tokens does not reproduce to the bit (nor the tiny
    model's greedy choices)."""
    yield from pair(model, fabric, failure_policy="fail")


def pair(model: str, fabric: Loopback, failure_policy: str):
    p = make_engine(
        model, fabric, failure_policy=failure_policy, lease_timeout=30, kv_checksum=True
    )
    d = make_engine(model, fabric, kv_checksum=True, lease_timeout=30)
    connect(p, d)
    yield p, d
    for engine in (p, d):
        engine.connector.close()


def conversation(seed: int, first: int = 40, then: int = 20) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (first, then)]


def second_turn(d: LLMEngine, seed: int) -> list[int]:
    """Turn 1 runs on D alone (its prompt and answer are then in D's prefix cache); turn 2's
    prompt is turn 1's, its answer and a new message. D computed the KV of every token but the
    answer's last: 40 + 24 tokens, 4 whole blocks."""
    first, message = conversation(seed)
    answer, out = run(d, first, sampling("greedy", max_tokens=25), rid=f"turn1-{seed}")
    assert out["error"] is None
    return first + answer + message


def second_turn_on_both(d: LLMEngine, twins, seed: int) -> list[int]:
    """`second_turn` on D and on D's twin, which then hold the same turn 1."""
    prompt = second_turn(d, seed)
    assert second_turn(twins[1], seed) == prompt
    return prompt


def prefill_with(p: LLMEngine, prompt: list[int], lent: dict | None) -> dict:
    kv = {"do_remote_decode": True, **(lent or {})}
    tokens, out = run(p, prompt, sampling("greedy", max_tokens=1), kv, rid="prefill")
    assert out["error"] is None, out["error"]
    return out["kv"]


def loaded(engine: LLMEngine, mode: str) -> int:
    return engine.connector.stats_snapshot().loaded_requests.get(mode, 0)


def recomputed(engine: LLMEngine, reason: str) -> int:
    return engine.connector.stats_snapshot().recomputed.get(reason, 0)


def alone(twins, prompt: list[int]) -> list[int]:
    """Turn 2 on D's twin alone: turn 1's blocks from its own cache, the rest computed."""
    tokens, out = run(twins[1], prompt, sampling("greedy"), rid="alone")
    assert out["error"] is None
    return tokens


def without_reverse_pull(twins, prompt: list[int]) -> list[int]:
    """Turn 2 through today's P/D: P computes the whole prompt, D reads what it lacks."""
    p, d = twins
    return decode_from(d, prompt, prefill_with(p, prompt, None), rid="pd")


def decode_from(
    d: LLMEngine, prompt: list[int], params: dict, mode: str = "pull", rid: str = "d"
) -> list[int]:
    """D's greedy answer from the KV P's `params` name: D must load it (`mode`: a pull, or P's
    push), not compute it."""
    before = loaded(d, mode)
    tokens, out = run(d, prompt, sampling("greedy"), params, rid=rid)
    assert out["error"] is None
    assert loaded(d, mode) == before + 1, f"D computed the prompt instead of loading ({mode})"
    return tokens


def test_p_reads_the_prefix_d_holds_and_the_answer_equals_a_worker_alone(pd, twins):
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=1)
    expected = alone(twins, prompt)
    lent = d.lease_prefix(prompt)
    # turn 1's prompt and answer are 4 whole blocks on D: each lent, and held there
    assert lent["prefix_only"] and len(lent["remote_block_ids"]) == 64 // BLOCK
    assert d.connector.stats_snapshot().num_blocks_held == 64 // BLOCK
    before = p.connector.stats_snapshot()
    params = prefill_with(p, prompt, lent)
    after = p.connector.stats_snapshot()
    assert after.loaded_requests.get("reverse", 0) == before.loaded_requests.get("reverse", 0) + 1
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in p.kv_caches)
    assert after.num_bytes_loaded - before.num_bytes_loaded == 4 * block_bytes
    assert after.recomputed == before.recomputed
    # D then reads from P only the blocks it lacks, and decodes what a worker alone would
    assert decode_from(d, prompt, params) == expected
    settle(p, d, *twins)  # D's lease ended with P's read: every block back in both pools


def test_a_prefix_p_cannot_read_is_computed_there_under_either_policy(pd, twins):
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=2)
    expected = without_reverse_pull(twins, prompt)
    lent = d.lease_prefix(prompt)
    before = recomputed(p, "read_failed")
    p.connector.faults.num_failed_reads = 1
    params = prefill_with(p, prompt, lent)
    assert recomputed(p, "read_failed") == before + 1
    assert decode_from(d, prompt, params) == expected
    settle(p, d, *twins)  # the failed read still gave D's lease back


def test_a_prefix_that_does_not_check_out_is_never_used(pd, twins):
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=3)
    expected = without_reverse_pull(twins, prompt)
    lent = d.lease_prefix(prompt)
    assert lent["kv_checksums"] is not None
    before = p.connector.stats_snapshot()
    p.connector.faults.num_corrupt_reads = 1
    params = prefill_with(p, prompt, lent)
    after = p.connector.stats_snapshot()
    assert after.num_checksum_failures == before.num_checksum_failures + 1
    assert after.loaded_requests == before.loaded_requests
    assert after.recomputed.get("checksum_mismatch", 0) == (
        before.recomputed.get("checksum_mismatch", 0) + 1
    )
    assert decode_from(d, prompt, params) == expected
    settle(p, d, *twins)


def test_a_lent_prefix_that_covers_the_whole_prompt_is_refused(pd, twins):
    """A prefix must leave P a token to compute (its logits give the first token): params that
    claim every block of the prompt are refused before anything is read, and P computes it."""
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=4)[:64]  # exactly the 4 blocks D holds
    expected = without_reverse_pull(twins, prompt)
    lent = d.lease_prefix(prompt + [5])
    assert len(lent["remote_block_ids"]) * BLOCK == len(prompt)
    before = p.connector.stats_snapshot()
    params = prefill_with(p, prompt, lent)
    after = p.connector.stats_snapshot()
    assert after.recomputed.get("remote_blocks_mismatch", 0) == (
        before.recomputed.get("remote_blocks_mismatch", 0) + 1
    )
    assert after.num_bytes_loaded == before.num_bytes_loaded  # nothing was read
    assert decode_from(d, prompt, params) == expected
    settle(p, d, *twins)


def test_nothing_cached_lends_nothing_and_a_release_ends_a_lease(pd):
    p, d = pd
    assert d.lease_prefix(conversation(seed=5)[0]) is None  # never seen by D
    prompt = second_turn(d, seed=6)
    lent = d.lease_prefix(prompt)
    assert d.connector.release_lease(lent["remote_request_id"])  # the proxy gave up on it
    settle(d)


def reserve_for(d: LLMEngine, prompt: list[int]) -> dict:
    """A push target on D for `prompt`, led by the blocks of it D holds (as
    /internal/kv/reserve answers it, given the prompt)."""
    res = d.reserve_push(len(prompt), prompt)
    return {**reserve_target(d, res), "num_held_blocks": res.num_held}


def pushed_bytes(p: LLMEngine) -> int:
    return p.connector.stats_snapshot().num_bytes_pushed


@pytest.mark.parametrize("lend", [True, False], ids=["read-from-d", "computed-on-p"])
def test_in_push_mode_p_writes_only_the_blocks_d_lacks(pd, twins, lend):
    """Push mode: D reserves the prompt's blocks starting with the 4 it holds (turn 1), P reads
    those (or computes them) and writes only the other 2, checksummed; D decodes what a
    worker alone (or today's P/D) would."""
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=7 if lend else 8)
    expected = alone(twins, prompt) if lend else without_reverse_pull(twins, prompt)
    target = reserve_for(d, prompt)
    assert target["num_held_blocks"] == 64 // BLOCK and len(target["block_ids"]) == 6
    lent = d.lease_prefix(prompt) if lend else None
    before_p, before_d = p.connector.stats_snapshot(), d.connector.stats_snapshot()
    params = prefill_with(p, prompt, {**(lent or {}), "push_to": target})
    after_p = p.connector.stats_snapshot()
    assert loaded(p, "reverse") == before_p.loaded_requests.get("reverse", 0) + lend
    assert after_p.recomputed == before_p.recomputed
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in p.kv_caches)
    assert after_p.num_bytes_pushed - before_p.num_bytes_pushed == 2 * block_bytes
    assert params["push_reservation_id"] and len(params["kv_checksums"][0]) == 2
    assert decode_from(d, prompt, params, mode="push") == expected
    after_d = d.connector.stats_snapshot()
    assert after_d.num_checksum_failures == before_d.num_checksum_failures
    settle(p, d, *twins)


def test_a_reservation_d_cannot_complete_gives_back_the_blocks_it_held(pd, twins):
    p, d = pd
    prompt = second_turn_on_both(d, twins, seed=9)
    free = d.pool.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        d.reserve_push(len(prompt) + BLOCK * (free + 1), prompt)
    settle(d)


def test_a_push_target_leaves_p_the_last_block_to_write():
    raw = {"engine_id": "d", "reservation_id": "r", "block_ids": [4, 5, 6], "host": "h", "port": 1}
    assert PushTarget.parse(raw).num_held_blocks == 0  # a D that holds nothing, or an older one
    assert PushTarget.parse({**raw, "num_held_blocks": 2}).num_held_blocks == 2
    for bad in (3, -1, "2"):
        with pytest.raises(KVTransferParamsError, match="push_to"):
            PushTarget.parse({**raw, "num_held_blocks": bad})
