"""The linear layer of the compiled path on a CPU (common/model/packed_linear.py): oneDNN on a
packed weight, and at one or two rows the C GEMV kernel (common/model/gemv.c) on the original
weight. Both against float64; the op takes the kernel at <= 2 rows and oneDNN above; without
the kernel (or where the CPU lacks what it needs) oneDNN runs every shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import common.model.packed_linear as pl
from common.model.packed_linear import PackedLinear, can_pack, gemv

SHAPES = [(960, 576), (37, 64), (5, 1536), (3072, 576)]  # N, K: N not a multiple of 16 too
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # relative to the largest output


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def kernel_runs(dtype: torch.dtype) -> bool:
    lib = pl._gemv_library()
    return lib is not None and bool(lib.pdserve_gemv_supports(int(dtype == torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float64(dtype, rows, with_bias):
    """Where the kernel runs (AVX-512; AVX512-BF16 for bf16: this project's machines have
    both) it matches float64 to the dtype's rounding; elsewhere it says so (None)."""
    gen = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        y = gemv(x, w, b)
        if not kernel_runs(dtype):
            assert y is None
            continue
        assert y.shape == (rows, n) and y.dtype == dtype
        assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_takes_the_kernel_at_two_rows_and_onednn_above(monkeypatch, dtype):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no native {dtype} on this CPU: the layer is not packed")
    calls = []
    real = pl.gemv

    def counted(x, w, b):
        y = real(x, w, b)
        calls.append((x.shape[0], y is not None))
        return y

    monkeypatch.setattr(pl, "gemv", counted)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=gen).to(dtype), torch.randn(960, generator=gen).to(dtype)
    layer = PackedLinear(w, b)
    for rows in (1, 2, 3, 32):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype]
    assert calls == [(1, kernel_runs(dtype)), (2, kernel_runs(dtype))]  # 3 and 32: oneDNN


def test_without_the_kernel_onednn_runs_every_shape(monkeypatch):
    monkeypatch.setattr(pl, "_gemv_library", lambda: None)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(960, 576, generator=gen)
    x = torch.randn(1, 576, generator=gen)
    assert gemv(x, w, None) is None
    with torch.inference_mode():
        y = PackedLinear(w)(x)
    assert relative_error(y, reference(x, w, None)) < TOLERANCE[torch.float32]
