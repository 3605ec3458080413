"""The engine end to end on a tiny model: batch invariance under chunked prefill, prefix hits and
preemption; stops; n > 1; aborts; bad input. Every scenario ends with the pool all free.

In float32: the invariances are bitwise, and bf16 (what `--dtype auto` picks on CPUs with native
bf16) rounds differently for different batch shapes, which flips the tiny model's near-ties."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.engine import LLMEngine
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

LENGTHS = (5, 16, 17, 33, 48, 70, 9, 64)  # below, at and past block boundaries (block 16)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def tiny_llm(tiny_model, **options) -> LLM:
    return LLM(str(tiny_model("llama")), dtype="float32", **options)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


# Each LLM compiles its model (~5 CPU-s on the tiny one): the tests that run the same options
# share one, made once for the module. Every test leaves its engine idle with no block in use
# (asserted), and what a test asserts does not depend on another test having run before it
# (greedy and seeded outputs do not change with prefix-cache hits, as
# test_prefix_cache_hit_gives_same_output shows).
@pytest.fixture(scope="module")
def no_prefix_llm(tiny_model) -> LLM:
    return tiny_llm(tiny_model, num_blocks=64, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def plain_llm(tiny_model) -> LLM:
    return tiny_llm(tiny_model, num_blocks=64)


@pytest.fixture(scope="module")
def alone(no_prefix_llm):
    """Each prompt on its own, no prefix cache, one prefill chunk."""
    llm = no_prefix_llm
    results = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        results[name] = [token_ids(llm.generate(p, params))[0] for p in prompts()]
    assert llm.engine.pool.is_all_free
    return results


@pytest.fixture(scope="module")
def chunked_llm(tiny_model) -> LLM:
    return tiny_llm(
        tiny_model, num_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False
    )


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_batch_with_chunked_prefill_equals_alone(chunked_llm, alone, mode):
    llm = chunked_llm
    params = GREEDY if mode == "greedy" else SEEDED
    assert token_ids(llm.generate(prompts(), params)) == alone[mode]
    assert llm.engine.pool.is_all_free


def test_prefix_cache_hit_gives_same_output(tiny_model, alone):
    llm = tiny_llm(tiny_model, num_blocks=64, max_num_batched_tokens=64)
    first = llm.generate(prompts(), GREEDY)
    second = llm.generate(prompts(), GREEDY)
    assert token_ids(first) == token_ids(second) == alone["greedy"]
    cached = [o.num_cached_tokens for o in second]
    assert cached[5] == 64 and cached[0] == 0, cached  # 70 tokens: 4 full blocks hit
    assert llm.engine.pool.num_used_blocks == 0  # cached blocks are evictable, not in use
    assert llm.engine.pool.num_hits > 0


def test_preempted_requests_give_same_output(tiny_model, alone):
    # 16 blocks of 16 tokens cannot hold all 8 requests at once: some are preempted and recomputed
    llm = tiny_llm(tiny_model, num_blocks=16, max_model_len=256)
    for mode, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        assert token_ids(llm.generate(prompts(), params)) == alone[mode]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_used_blocks == 0


def test_max_num_seqs_limits_the_running_batch(tiny_model, alone):
    llm = tiny_llm(tiny_model, num_blocks=64, max_num_seqs=2)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert engine.pool.num_used_blocks == 0


def test_stop_string_token_and_length(plain_llm):
    llm = plain_llm
    prompt = prompts()[3]
    base = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {base.text!r}"
    cut = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[: base.text.find(stop)]
    stop_id = base.token_ids[5]
    by_id = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert llm.engine.pool.num_used_blocks == 0


def test_n_samples_and_logprobs(plain_llm):
    llm = plain_llm
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=2)
    out = llm.generate(prompts()[2], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in c.logprobs)
    assert llm.engine.pool.num_used_blocks == 0


def test_abort_frees_blocks(tiny_model):
    llm = tiny_llm(tiny_model, num_blocks=64, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("a", prompts()[5], GREEDY)  # 70 tokens: several prefill chunks
    engine.add_request("b", prompts()[1], GREEDY)
    engine.step()
    engine.abort_request("a")
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.abort_request("b")
    assert engine.pool.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, field, limit",
    [
        (dict(temperature=-0.5), "temperature", ">= 0"),
        (dict(top_p=0.0), "top_p", "(0, 1]"),
        (dict(top_p=1.5), "top_p", "(0, 1]"),
        (dict(max_tokens=0), "max_tokens", ">= 1"),
        (dict(top_k=-3), "top_k", ">= 1"),
        (dict(temperature=float("nan")), "temperature", ">= 0"),
    ],
)
def test_invalid_sampling_params(params, field, limit):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**params)
    assert limit in str(err.value)


def test_invalid_prompts(plain_llm):
    engine: LLMEngine = plain_llm.engine
    limit = engine.max_model_len  # the tiny model's 512
    with pytest.raises(ValueError, match=rf"prompt is {limit} tokens, max_model_len is {limit}"):
        engine.add_request("long", [5] * limit)
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\)"):
        engine.add_request("oov", [5, VOCAB])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("stop", [5, 6], SamplingParams(stop_token_ids=[VOCAB + 1]))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    assert not engine.has_unfinished_requests() and engine.pool.is_all_free


def test_n_children_share_prompt_blocks_and_match_single_requests(plain_llm, no_prefix_llm):
    llm = plain_llm
    engine = llm.engine
    prompt = prompts()[4]  # 48 tokens: the last block is recomputed by every child
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("p", prompt, params)
    shared = None
    while engine.has_unfinished_requests():
        engine.step()
        children = [r for r in engine.scheduler.running if r.request_id.startswith("p#")]
        if len(children) == 3 and shared is None:
            shared = [c.block_ids[:2] for c in children]
            refs = [b.ref_count for b in children[0].blocks[:2]]
    assert shared[0] == shared[1] == shared[2] and refs == [3, 3]
    assert engine.pool.num_used_blocks == 0
    # each child i samples as a lone request with seed 11 + i would
    llm2 = no_prefix_llm
    together = llm.generate(prompt, params)[0].outputs
    for i, child in enumerate(together):
        alone = llm2.generate(prompt, dataclasses.replace(params, n=1, seed=11 + i))[0]
        assert child.token_ids == alone.outputs[0].token_ids
