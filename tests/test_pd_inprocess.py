"""P/D semantics between two engines in this process, over the `FakeConnector` (the NIXL
connector's halves on a loopback wire, common/kv_transfer/fake.py): the same lifecycle, leases,
reservations, checksums and failure policy as between workers, in a fraction of the time. The
wire itself, HTTP and the proxy are tested between real processes (test_pd_pull.py,
test_pd_push.py, tests/chaos/).
"""

from __future__ import annotations

import time

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
from common.engine.engine import LLMEngine
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.fake import FakeConnector, Loopback
from tests.tiny_models import VOCAB

LENGTHS = [3, 16, 17, 40, 65]  # under, at and past a block's 16 tokens, several blocks


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def num_recomputed(before, after, reason: str) -> int:
    """Requests recomputed for `reason` between two stats snapshots of D."""
    return after.recomputed.get(reason, 0) - before.recomputed.get(reason, 0)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def fabric():
    return Loopback()


def make_engine(model: str, fabric: Loopback, dtype: str = "float32", **transfer) -> LLMEngine:
    # NOTE: no prefix cache: a local hit would skip the very reads under test
    config = EngineConfig(
        ModelConfig(model, dtype=dtype, max_model_len=256, enforce_eager=True),
        CacheConfig(num_blocks=48, enable_prefix_caching=False),
        transfer=TransferConfig(**transfer),
    )
    return LLMEngine(config, make_connector=lambda *args: FakeConnector(*args, fabric))


def connect(a: LLMEngine, b: LLMEngine) -> None:
    """Each knows the other, as after the HTTP handshake."""
    for x, y in ((a, b), (b, a)):
        info = y.connector.peer_info()
        x.connector.add_peer(info.layout, info.metadata)


@pytest.fixture(scope="module")
def p(model, fabric):
    return make_engine(model, fabric, kv_checksum=True, lease_timeout=30)


@pytest.fixture(scope="module", params=["fail", "recompute"])
def d(request, model, fabric, p):
    engine = make_engine(model, fabric, failure_policy=request.param, load_timeout=10)
    connect(p, engine)
    return engine


def run(
    engine: LLMEngine, prompt, params: SamplingParams, kv=None, rid="r", resume=None
) -> tuple[list, dict]:
    """Step until the request finishes: (token ids, its last output's kv_transfer_params and
    error)."""
    engine.add_request(rid, prompt, params, kv, resume)
    for _ in range(1000):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids), {
                    "kv": out.kv_transfer_params,
                    "error": out.error,
                }
    raise AssertionError(f"{rid} did not finish")


def sampling(mode: str, max_tokens: int = 8) -> SamplingParams:
    seeded = dict(temperature=0.9, seed=7) if mode == "seeded" else dict(temperature=0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **seeded)


def prefill(p: LLMEngine, prompt, mode: str = "greedy", push_to: dict | None = None) -> dict:
    """P's answer for `prompt`: where D finds its KV, with P's first token."""
    kv = {"do_remote_decode": True, **({"push_to": push_to} if push_to else {})}
    tokens, out = run(p, prompt, sampling(mode, max_tokens=1), kv, rid="prefill")
    assert out["error"] is None, out["error"]
    assert out["kv"]["first_token_id"] == tokens[0]
    return out["kv"]


def settle(*engines: LLMEngine) -> None:
    """Notifications delivered, leases released: every block back in every pool."""
    for _ in range(100):
        for engine in engines:
            engine.poll_transfers()
        if all(e.pool.is_all_free and not e.has_pending_transfers() for e in engines):
            return
        time.sleep(0.01)
    raise AssertionError([(e.pool.num_free_blocks, e.has_pending_transfers()) for e in engines])


def reserve(d: LLMEngine, num_tokens: int) -> dict:
    """A push target on D, as /internal/kv/reserve answers it."""
    return target(d, d.connector.reserve(num_tokens))


def target(d: LLMEngine, res) -> dict:
    """The push target of D's reservation `res`."""
    return {
        "engine_id": d.config.transfer.engine_id,
        "reservation_id": res.reservation_id,
        "block_ids": [b.block_id for b in res.blocks],
        "host": "127.0.0.1",
        "port": 0,
        "write_by": res.write_by,
    }


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_pull_equals_colocated_and_is_loaded_not_recomputed(p, d, mode):
    before = d.connector.stats_snapshot()
    for prompt in prompts():
        colocated, _ = run(d, prompt, sampling(mode))
        params = prefill(p, prompt, mode)
        assert params["first_token_id"] == colocated[0]  # P's first token is D's
        assert len(params["remote_block_ids"]) == -(-len(prompt) // 16)
        assert len(params["kv_checksums"]) == 3  # per layer of the tiny model
        tokens, out = run(d, prompt, sampling(mode), params)
        assert out["error"] is None and tokens == colocated, (len(prompt), tokens, colocated)
        settle(p, d)  # D told P to let go: both pools whole
    after = d.connector.stats_snapshot()
    assert after.loaded_requests.get("pull", 0) - before.loaded_requests.get("pull", 0) == 5
    assert after.num_loads - before.num_loads == 5 and after.num_load_failures == 0
    assert after.recomputed == before.recomputed
    assert after.num_bytes_loaded > before.num_bytes_loaded
    assert after.num_checksum_failures == before.num_checksum_failures  # every layer checked


def test_a_request_aborted_before_its_read_gives_the_lease_back_at_once(p, d):
    """A pulling request that D aborts while it waits to be scheduled (its client left) tells P
    at once: P's blocks do not wait out the lease (30 s here)."""
    prompt = prompts()[3]
    kv = prefill(p, prompt)
    assert p.pool.num_free_blocks < p.pool.num_blocks  # leased to D
    d.add_request("gone", prompt, sampling("greedy"), kv)
    d.abort_request("gone")
    settle(p, d)  # one second at most
    assert p.connector.stats_snapshot().num_lease_expiries == 0


def test_first_token_from_p_or_recomputed_on_d(p, d):
    """With P's first token D generates from the second; without it (vLLM's params) D samples
    the first itself from the loaded KV: the same tokens either way."""
    prompt = prompts()[3]
    colocated, _ = run(d, prompt, sampling("greedy"))
    for keep_first in (True, False):
        params = prefill(p, prompt)
        if not keep_first:
            params = {k: v for k, v in params.items() if k != "first_token_id"}
        tokens, out = run(d, prompt, sampling("greedy"), params)
        assert out["error"] is None and tokens == colocated
        settle(p, d)


def test_first_token_that_ends_the_request_needs_no_kv(p, d):
    prompt = prompts()[2]
    params = prefill(p, prompt)
    before = d.connector.stats_snapshot()
    tokens, out = run(d, prompt, sampling("greedy", max_tokens=1), params)
    assert tokens == [params["first_token_id"]] and out["error"] is None
    assert d.connector.stats_snapshot().num_loads == before.num_loads  # nothing read
    settle(p, d)  # and P was told to let go of its blocks


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_resume_from_kv_of_the_prompt_and_outputs_so_far(p, d, mode):
    """A migrated stream with a long context: P prefills the prompt plus the G outputs so far
    (one prompt of token ids), D resumes the choice on that KV without P's token: it recomputes
    the last token and samples token G itself (its penalties and seeded draw). The KV is read,
    not recomputed, though it covers more blocks than the prompt."""
    prompt, g = prompts()[3], 9  # 40 + 9 tokens: a block more than the prompt's 3
    colocated, _ = run(d, prompt, sampling(mode, max_tokens=14))
    params = prefill(p, prompt + colocated[:g], mode)
    assert len(params["remote_block_ids"]) == -(-(len(prompt) + g) // 16) == 4
    params = {k: v for k, v in params.items() if k != "first_token_id"}
    before = d.connector.stats_snapshot()
    resume = Resume(0, tuple(colocated[:g]), 0)
    tokens, out = run(d, prompt, sampling(mode, max_tokens=14), params, resume=resume)
    assert out["error"] is None and tokens == colocated, (tokens, colocated)
    after = d.connector.stats_snapshot()
    assert after.loaded_requests.get("pull", 0) - before.loaded_requests.get("pull", 0) == 1
    assert after.num_loads - before.num_loads == 1 and after.recomputed == before.recomputed
    assert after.num_load_failures == before.num_load_failures
    settle(p, d)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_push_equals_colocated(p, d, mode):
    before = d.connector.stats_snapshot()
    for prompt in prompts():
        colocated, _ = run(d, prompt, sampling(mode))
        params = prefill(p, prompt, mode, push_to=reserve(d, len(prompt)))
        assert params["push_reservation_id"] and not params["remote_block_ids"]
        tokens, out = run(d, prompt, sampling(mode), params)
        assert out["error"] is None and tokens == colocated, (len(prompt), tokens, colocated)
        settle(p, d)
    after = d.connector.stats_snapshot()
    assert after.loaded_requests.get("push", 0) - before.loaded_requests.get("push", 0) == 5
    assert after.recomputed == before.recomputed
    assert p.connector.stats_snapshot().num_bytes_pushed > 0


def test_failed_read_fails_or_recomputes_by_policy(p, d):
    prompt = prompts()[3]
    colocated, _ = run(d, prompt, sampling("greedy"))
    params = prefill(p, prompt)
    before = d.connector.stats_snapshot()
    d.connector.faults.num_failed_reads = 1
    tokens, out = run(d, prompt, sampling("greedy"), params)
    after = d.connector.stats_snapshot()
    assert after.num_load_failures == before.num_load_failures + 1
    if d.config.transfer.failure_policy == "fail":
        assert "KV read failed" in out["error"] and "did not arrive" in out["error"]
    else:
        assert out["error"] is None and tokens == colocated
        assert num_recomputed(before, after, "read_failed") == 1
    settle(p, d)


def test_checksum_mismatch_is_never_decoded(p, d):
    prompt = prompts()[3]
    colocated, _ = run(d, prompt, sampling("greedy"))
    params = prefill(p, prompt)
    assert params["kv_checksums"] is not None
    before = d.connector.stats_snapshot()
    d.connector.faults.num_corrupt_reads = 1
    tokens, out = run(d, prompt, sampling("greedy"), params)
    after = d.connector.stats_snapshot()
    assert after.num_checksum_failures == before.num_checksum_failures + 1
    if d.config.transfer.failure_policy == "fail":
        assert "checksum" in out["error"], out["error"]
    else:
        assert out["error"] is None and tokens == colocated
        assert num_recomputed(before, after, "checksum_mismatch") == 1
    settle(p, d)


def test_kv_past_its_lease_is_never_read(model, fabric, d):
    """P frees blocks whose reader is too late; D's read is then refused by the deadline the
    lease sets, and the request fails or is recomputed, never decoded from reused blocks."""
    short = make_engine(model, fabric, lease_timeout=0.2)
    connect(short, d)
    prompt = prompts()[3]
    colocated, _ = run(d, prompt, sampling("greedy"))
    params = prefill(short, prompt)
    time.sleep(0.3)
    short.poll_transfers()
    assert short.connector.stats_snapshot().num_lease_expiries == 1 and short.pool.is_all_free
    tokens, out = run(d, prompt, sampling("greedy"), params)
    if d.config.transfer.failure_policy == "fail":
        assert out["error"] is not None and "deadline" in out["error"], out["error"]
    else:
        assert out["error"] is None and tokens == colocated
    settle(d)
    d.connector.retire_peer(short.config.transfer.engine_id)
    short.connector.close()


def test_blocks_reused_after_the_lease_are_caught_by_the_checksum(model, fabric, d):
    """Without the lease's deadline (a peer that sends none) D reads past it: the checksum is
    what catches the blocks P has given another prompt meanwhile (the deadline itself:
    test_kv_past_its_lease_is_never_read, and tests/chaos/test_lease_faults.py)."""
    short = make_engine(model, fabric, kv_checksum=True, lease_timeout=0.2)
    connect(short, d)
    victim = prompts()[-1]
    colocated, _ = run(d, victim, sampling("greedy"))
    params = prefill(short, victim)
    del params["read_by"]
    time.sleep(0.3)
    short.poll_transfers()
    assert short.connector.stats_snapshot().num_lease_expiries == 1
    run(short, victim[::-1], sampling("greedy", max_tokens=1), rid="other")  # reuses the blocks
    before = d.connector.stats_snapshot()
    tokens, out = run(d, victim, sampling("greedy"), params)
    after = d.connector.stats_snapshot()
    assert after.num_checksum_failures == before.num_checksum_failures + 1
    assert after.loaded_requests == before.loaded_requests  # not one more loaded request
    if d.config.transfer.failure_policy == "fail":
        assert "checksum mismatch" in out["error"], out["error"]
    else:
        assert out["error"] is None and tokens == colocated
        assert num_recomputed(before, after, "checksum_mismatch") == 1
    settle(short, d)
    d.connector.retire_peer(short.config.transfer.engine_id)
    short.connector.close()


def test_reservation_gone_before_the_push_landed(model, fabric, p, d):
    """A reservation released (or expired) before every chunk landed is never decoded from;
    its blocks stay reserved until it expires, for a late P to write into harmlessly."""
    policy = d.config.transfer.failure_policy
    d = make_engine(model, fabric, failure_policy=policy, lease_timeout=1.0)
    prompt = prompts()[3]
    colocated, _ = run(d, prompt, sampling("greedy"))
    target = reserve(d, len(prompt))
    assert d.connector.release_reservation(target["reservation_id"])
    d.poll_transfers()
    assert d.pool.num_free_blocks == d.pool.num_blocks - len(target["block_ids"])  # kept
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": p.config.transfer.engine_id,
        "remote_block_ids": [],
        "remote_request_id": "never-pushed",
        "remote_host": "127.0.0.1",
        "remote_port": 0,
        "first_token_id": colocated[0],
        "push_reservation_id": target["reservation_id"],
    }
    tokens, out = run(d, prompt, sampling("greedy"), params)
    if policy == "fail":
        assert "did not fully arrive" in out["error"], out["error"]
    else:
        assert out["error"] is None and tokens == colocated
        assert d.connector.stats_snapshot().recomputed == {"push_incomplete": 1}
    time.sleep(1.1)
    settle(d)  # expired: freed
    d.connector.close()


def test_another_dtype_is_refused_as_a_peer(model, fabric, d):
    other = make_engine(model, fabric, dtype="bfloat16")
    info = other.connector.peer_info()
    with pytest.raises(ValueError, match="dtype"):
        d.connector.add_peer(info.layout, info.metadata)
    assert not d.connector.has_peer(other.config.transfer.engine_id)
    other.connector.close()
