"""The C causal prefill attention kernel (native_prefill.c): each of its paths against float64,
no further from it than SDPA is (in bf16: no further than the float64 answer rounded once); one
call over many sequences; the backend's wiring. The engine in bf16 with it:
test_bf16_parity.py.

Every path this CPU can run is built and checked: `-march=native` (AVX-512 with BF16 here, or
whatever the CPU has), `x86-64-v3` (the generic C code vectorized for AVX2 and FMA) and
`x86-64-v2` (the generic C code without them).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F

from common.attention.backends.native_prefill import native_prefill, prefill_seqs
from common.attention.backends.torch_paged import TorchPagedBackend
from common.native import choice
from tests.test_native_decode import _march_params, checked_build

LENGTHS = [1, 15, 16, 17, 128, 300]


@cache
def _kernel(march: str):
    return checked_build(native_prefill(march), march)


def _reference(q, k, v, scale) -> torch.Tensor:
    """float64 causal attention of one sequence: q (L, Hq, D), k/v (L, Hkv, D) -> (L, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))  # (H, L, D)
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale  # (Hq, L, L)
    later = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    return (scores.masked_fill(later, float("-inf")).softmax(-1) @ vd).transpose(0, 1)


def _sdpa(q, k, v, scale) -> torch.Tensor:
    """What the backend runs without the kernel (torch_paged._prefill's call)."""
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _errors(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max, root mean square) of |out - want|."""
    diff = (out.double() - want).abs()
    return diff.max().item(), diff.square().mean().sqrt().item()


@pytest.mark.parametrize("march", _march_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    [(3, 3, 64), (1, 16, 256), (2, 1, 40)],
    ids=["smollm2", "g16-256", "mha-40"],
)
def test_native_prefill_is_as_near_float64_as_sdpa(march, dtype, kv_heads, group, dim):
    """Each path on SmolLM2's heads (9 query heads on 3 KV heads, head dim 64), the largest
    group and head dim it takes, and a head dim its vector code does not take (40: the generic
    loops), at lengths around the 32-position tiles: its error against float64 is no larger
    than SDPA's on the same inputs, in root mean square; its largest error, which the output's
    own rounding dominates in bf16 and which sums over 256 values one order or another move in
    fp32, at most twice SDPA's largest."""
    gen = torch.Generator().manual_seed(dim + group)
    scale = dim**-0.5
    for length in LENGTHS:
        q = torch.randn(length, kv_heads * group, dim, generator=gen).to(dtype)
        k, v = torch.randn(2, length, kv_heads, dim, generator=gen).to(dtype)
        out = _kernel(march)(q, k, v, prefill_seqs([0], [length]), scale)
        assert out.dtype == dtype and out.shape == q.shape
        want = _reference(q, k, v, scale)
        ours, theirs = _errors(out, want), _errors(_sdpa(q, k, v, scale), want)
        what = f"length {length}: ours (max, rms) {ours}, SDPA's {theirs}"
        assert ours[1] <= theirs[1], what
        assert ours[0] <= 2 * theirs[0] + 1e-12, what
        if dtype == torch.bfloat16:  # float32 inside: the float64 answer, rounded once
            rounded = _errors(want.to(dtype), want)
            assert ours[1] <= 1.01 * rounded[1], f"{what}, rounding's {rounded}"


@pytest.mark.parametrize("march", _march_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_over_many_sequences_equals_one_call_each(march, dtype):
    """A step's sequences in one call, from views into a fused QKV row (as the model's split
    leaves them), with a gap of rows no sequence holds: each sequence's output is bit for bit
    the one of a call on it alone, and the gap is left as it was."""
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    lens = [128, 1, 33, 300, 16]
    begin = [0, 128, 129, 170, 470]  # rows 162-169: no sequence
    total = begin[-1] + lens[-1]
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(total, heads, dim), k.view(total, kv_heads, dim), v.view(total, kv_heads, dim)
    kernel = _kernel(march)
    out = torch.full((total, heads, dim), 7.0, dtype=dtype)
    ends = [b + n for b, n in zip(begin, lens)]
    kernel(q, k, v, prefill_seqs(begin, ends), scale, out=out)
    for b, e in zip(begin, ends):
        one = kernel(q[b:e], k[b:e], v[b:e], prefill_seqs([0], [e - b]), scale)
        assert torch.equal(out[b:e], one)
    assert (out[162:170] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backend_runs_a_steps_new_prefills_in_one_call(monkeypatch, dtype):
    """The compiled path's backend (native) on a step of two decodes, two prefills without a
    cached prefix and one with: in bf16 the kernel runs once, on the two, SDPA the third, and
    the output is as near float64 as SDPA's alone (rms; largest error at most twice); in fp32
    (or where this CPU's build does not take bf16) it does not run."""
    from tests.test_attention_backends import SCALE, build_batch, expected_output

    backend = TorchPagedBackend(native=True)
    real = backend.native_prefill
    assert real is not None
    batch = build_batch([(3, 1), (9, 1), (0, 40), (12, 7), (0, 5)], block_size=4)
    q, k, v, kv_cache = (t.to(dtype) for t in (batch.query, batch.key, batch.value, batch.kv_cache))
    want = expected_output(batch, None)
    backend.native_prefill = None  # the same decode path, SDPA for every prefill
    sdpa = backend.forward(q, k, v, kv_cache.clone(), batch.meta, SCALE, None)
    calls = []
    monkeypatch.setattr(backend, "native_prefill", Counted(real, calls))
    out = backend.forward(q, k, v, kv_cache, batch.meta, SCALE, None)
    runs = real.takes(dtype)
    assert calls == ([[2, 49]] if runs else [])  # after the decodes; (12, 7) kept SDPA
    ours, theirs = _errors(out, want), _errors(sdpa, want)
    assert ours[1] <= theirs[1] and ours[0] <= 2 * theirs[0], f"ours {ours}, SDPA's {theirs}"
    backend.record_prefill_path(dtype)
    made = {c.shape: c for c in choice.choices() if c.kernel == "prefill_attention"}
    assert made[str(dtype).removeprefix("torch.")].path == (real.path if runs else "torch")


class Counted:
    """A NativePrefill that notes each call's sequence starts in `calls`."""

    def __init__(self, real, calls: list):
        self.real, self.calls = real, calls

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, q, k, v, seqs, scale, out=None):
        self.calls.append(seqs.begin.tolist())
        return self.real(q, k, v, seqs, scale, out=out)
