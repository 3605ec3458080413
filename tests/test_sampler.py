"""Sampler tests: greedy, top_k/top_p/min_p, seeding, penalties, min_tokens, logprobs, params."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from common.engine.sampler import Sampler, apply_penalties, inverse_cdf, top_k_top_p_cutoff
from common.engine.sampling_params import SamplingParams

EOS = 0


@dataclass
class FakeSeq:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        seed = self.sampling_params.seed
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)


def seqs_of(*params: SamplingParams) -> list[FakeSeq]:
    return [FakeSeq(p) for p in params]


def sample_ids(logits: torch.Tensor, seqs: list[FakeSeq]) -> list[int]:
    return [t.token_id for t in Sampler([EOS])(logits, seqs)]


def hand_built(probs: list[float], vocab_size: int = 300) -> tuple[torch.Tensor, list[int]]:
    """Logits (V,) whose top tokens have `probs` (rest share the remainder), under shuffled ids."""
    rest = (1 - sum(probs)) / max(vocab_size - len(probs), 1)
    ordered = torch.tensor(probs + [rest] * (vocab_size - len(probs))).log()
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(7))
    logits = torch.empty(vocab_size)
    logits[ids] = ordered
    return logits, ids.tolist()


def draw_many(logits: torch.Tensor, params: dict, num: int = 2000) -> torch.Tensor:
    """`num` draws from one row, each by its own seeded generator (one batch of `num` rows)."""
    seqs = seqs_of(*[SamplingParams(seed=i, **params) for i in range(num)])
    return torch.tensor(sample_ids(logits.expand(num, -1), seqs))


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax_on_fast_and_slow_paths():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    fast = seqs_of(*[SamplingParams(temperature=0)] * 8)
    assert sample_ids(logits, fast) == logits.argmax(-1).tolist()
    slow = seqs_of(*[SamplingParams(temperature=0, logprobs=1)] * 4, *[SamplingParams()] * 4)
    assert sample_ids(logits, slow)[:4] == logits[:4].argmax(-1).tolist()


def test_greedy_ties_pick_the_first():
    logits = torch.tensor([[1.0, 3.0, 3.0]])
    assert sample_ids(logits, seqs_of(SamplingParams(temperature=0))) == [1]


def test_top_k_1_equals_greedy():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    seqs = seqs_of(*[SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(6)])
    assert sample_ids(logits, seqs) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-3, 1e-7])
def test_temperature_to_zero_is_greedy(temperature):
    gen = torch.Generator().manual_seed(2)
    logits = torch.stack([torch.randperm(400, generator=gen) * 0.1 for _ in range(4)]).float()
    for seed in range(50):
        seqs = seqs_of(*[SamplingParams(temperature=temperature, seed=seed)] * 4)
        assert sample_ids(logits, seqs) == logits.argmax(-1).tolist()


# --- filters ---------------------------------------------------------------------------------

PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]


@pytest.mark.parametrize(
    ("params", "num_allowed", "expected"),
    [
        ({"top_k": 3}, 3, [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8]),
        ({"top_p": 0.6}, 2, [0.4 / 0.65, 0.25 / 0.65]),
        ({"top_p": 0.7}, 3, [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8]),
        ({"min_p": 0.3}, 3, [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8]),
        ({"min_p": 0.2}, 4, [0.4 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.1 / 0.9]),
        # top_p applies to the top_k-renormalised distribution: 0.5, 0.3125, ... -> 2 tokens, not 3
        ({"top_k": 3, "top_p": 0.75}, 2, [0.4 / 0.65, 0.25 / 0.65]),
        ({"top_k": 5, "min_p": 0.3, "top_p": 0.95}, 3, [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8]),
    ],
)
def test_filters_never_emit_a_filtered_token(params, num_allowed, expected):
    logits, ids = hand_built(PROBS)
    drawn = draw_many(logits, params)
    allowed = ids[:num_allowed]
    assert set(drawn.tolist()) == set(allowed)
    freqs = [(drawn == t).float().mean().item() for t in allowed]
    assert freqs == pytest.approx(expected, abs=0.04)


def test_temperature_flattens_the_distribution():
    probs = [0.5, 0.3, 0.2]
    logits, ids = hand_built(probs, vocab_size=3)
    drawn = draw_many(logits, {"temperature": 2.0})
    expected = torch.tensor(probs).sqrt() / torch.tensor(probs).sqrt().sum()
    freqs = [(drawn == t).float().mean().item() for t in ids]
    assert freqs == pytest.approx(expected.tolist(), abs=0.04)


def reference_num_kept(row: torch.Tensor, top_k: int, top_p: float) -> int:
    """Sort-based (float64) top_k then top_p (> 1: off): how many tokens are kept."""
    probs = row.double().softmax(-1).sort(descending=True).values[:top_k]
    probs = probs / probs.sum()
    return int((probs.cumsum(-1) - probs < top_p).sum())


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # nearly flat (full sort) ... peaked
def test_top_k_top_p_cutoff_matches_sort_reference(scale):
    vocab_size = 5000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab_size, generator=gen) * scale
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    top_k = torch.tensor([vocab_size, 3, 2500, vocab_size, 40, vocab_size])
    top_p = torch.tensor([0.5, 2.0, 0.9, 0.99, 0.3, 2.0])
    cutoff = top_k_top_p_cutoff(weights, top_k, top_p)
    for i in range(6):
        expected = reference_num_kept(logits[i], int(top_k[i]), top_p[i].item())
        assert int((weights[i] >= cutoff[i]).sum()) == expected


def test_wide_nucleus_keeps_exactly_the_reference_set():
    vocab_size = 5000
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(4)) * 0.1
    num_kept = reference_num_kept(logits, vocab_size, 0.5)
    allowed = set(logits.topk(num_kept).indices.tolist())
    assert set(draw_many(logits, {"top_p": 0.5}, num=500).tolist()) <= allowed


def test_inverse_cdf_never_picks_a_zero_weight_token():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 3)
    uniforms = torch.tensor([0.0, 0.5, 1 - 2**-24])
    assert inverse_cdf(weights, uniforms).tolist() == [1, 3, 3]


def test_sampling_leaves_the_input_logits_unchanged():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(6))
    before = logits.clone()
    seqs = seqs_of(
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2, temperature=0.3),
        SamplingParams(top_k=3, seed=1),
        SamplingParams(temperature=0),
    )
    Sampler([EOS])(logits, seqs)
    assert torch.equal(logits, before)


# --- seeding ---------------------------------------------------------------------------------


def run_steps(
    seqs: list[FakeSeq], num_steps: int, keys: list[int] | None = None, vocab_size: int = 2000
) -> list[list[int]]:
    """Decode `num_steps` steps; a seq's logits depend only on (step, its key), key = index."""
    sampler = Sampler([EOS])
    keys = keys or list(range(len(seqs)))
    for step in range(num_steps):
        rows = [
            torch.randn(vocab_size, generator=torch.Generator().manual_seed(step * 1000 + k))
            for k in keys
        ]
        for seq, out in zip(seqs, sampler(torch.stack(rows), seqs), strict=True):
            seq.output_token_ids.append(out.token_id)
    return [seq.output_token_ids for seq in seqs]


def test_seeded_request_reproduces_alone_and_in_a_mixed_batch():
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=42)
    alone = run_steps([FakeSeq(target)], 20)[0]
    others = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(seed=7, min_p=0.1, frequency_penalty=0.5),
        SamplingParams(top_k=5, repetition_penalty=1.3, logprobs=2),
    ]
    batch = seqs_of(*others[:2], target, *others[2:])
    assert run_steps(batch, 20, keys=[1, 2, 0, 3, 4])[2] == alone  # same logits as alone
    assert run_steps([FakeSeq(target)], 20)[0] == alone
    assert run_steps([FakeSeq(SamplingParams(temperature=0.8, top_p=0.9, seed=43))], 20)[0] != alone


def test_unseeded_requests_follow_the_global_rng():
    seqs = lambda: seqs_of(*[SamplingParams()] * 4)  # noqa: E731
    torch.manual_seed(0)
    first = run_steps(seqs(), 5)
    torch.manual_seed(0)
    assert run_steps(seqs(), 5) == first


# --- penalties -------------------------------------------------------------------------------


def test_apply_penalties_follows_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]] * 3)
    penalised = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seqs = [
        FakeSeq(penalised, prompt_token_ids=[0], output_token_ids=[1, 2, 1]),
        FakeSeq(SamplingParams(), prompt_token_ids=[0], output_token_ids=[1, 2, 1]),
        # presence / frequency only: the prompt token 0 is untouched
        FakeSeq(
            SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5),
            prompt_token_ids=[0, 4],
            output_token_ids=[3, 3, 3],
        ),
    ]
    apply_penalties(logits, seqs)
    # token 0: prompt only -> 2 / 2; token 1: -1 * 2 - 0.25 * 2 - 0.5; token 2: 0.5 / 2 - 0.25 - 0.5
    assert logits[0].tolist() == [1.0, -3.0, -0.5, -3.0, 1.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, -3.0, 1.0]
    assert logits[2].tolist() == [2.0, -1.0, 0.5, -3.0 - 1.5 + 1.0, 1.0]


def test_penalties_steer_the_sampler():
    logits = torch.tensor([[0.0, 0.0, 3.0, 2.9, 2.0, 1.0]])
    # presence/frequency look at the output only: token 2 in the prompt is not penalised
    seq = FakeSeq(SamplingParams(temperature=0, presence_penalty=1.0), prompt_token_ids=[2])
    assert sample_ids(logits, [seq]) == [2]
    seq = FakeSeq(SamplingParams(temperature=0, frequency_penalty=0.1), output_token_ids=[2, 2])
    assert sample_ids(logits, [seq]) == [3]
    # repetition looks at prompt and output: 3 / 1.6 and 2.9 / 1.6 fall below 2
    seq = FakeSeq(
        SamplingParams(temperature=0, repetition_penalty=1.6),
        prompt_token_ids=[2],
        output_token_ids=[3],
    )
    assert sample_ids(logits, [seq]) == [4]
    assert torch.equal(logits, torch.tensor([[0.0, 0.0, 3.0, 2.9, 2.0, 1.0]]))  # input untouched


# --- min_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_out", "ignore_eos", "expected"),
    [
        (1, False, 3),
        (1, True, EOS),
        (2, False, EOS),
        (2, True, EOS),
    ],
)
def test_min_tokens_masks_eos_and_stop_ids(num_out, ignore_eos, expected):
    logits = torch.tensor([[5.0, 4.0, 0.0, 3.0, 1.0]])  # eos 0 > stop 1 > token 3
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=ignore_eos)
    seq = FakeSeq(params, output_token_ids=[4] * num_out)
    assert sample_ids(logits, [seq]) == [expected]


def test_min_tokens_masks_when_sampling_too():
    logits = torch.tensor([10.0, 10.0, 0.0, 0.0, 1.0])
    drawn = draw_many(logits, {"min_tokens": 3, "stop_token_ids": [1]}, num=300)
    assert set(drawn.tolist()) <= {2, 3, 4} and 4 in drawn.tolist()


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_raw_and_sorted():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    raw = logits.log_softmax(-1)
    seqs = [
        FakeSeq(
            SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=4, seed=1),
            output_token_ids=[3, 9],
        ),
        FakeSeq(SamplingParams(temperature=0, logprobs=0)),
        FakeSeq(SamplingParams()),
    ]
    first, second, third = Sampler([EOS])(logits, seqs)
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    top_values, top_ids = raw[0].topk(4)
    assert [t for t, _ in first.top_logprobs] == top_ids.tolist()
    assert [v for _, v in first.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert [v for _, v in first.top_logprobs] == sorted(
        (v for _, v in first.top_logprobs), reverse=True
    )
    assert second.token_id == int(logits[1].argmax()) and second.top_logprobs == []
    assert second.logprob == pytest.approx(raw[1].max().item(), abs=1e-6)
    assert third.logprob is None and third.top_logprobs is None


# --- SamplingParams validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"min_p": math.nan}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)
