"""The linear layer of the compiled path on a CPU (common/model/packed_linear.py): the C kernel
in common/model/skinny_gemm.c on its packed weight where it runs, oneDNN on its own packed
weight elsewhere. Both against float64; a row's result from the kernel does not depend on the
rows batched with it; without the kernel (or for a shape it does not pack) oneDNN runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import common.model.packed_linear as pl
from common.model.packed_linear import PackedLinear, can_pack, skinny_gemm, skinny_pack

# N, K: N not a multiple of 16, K of 16 or 32 values, K long
SHAPES = [(960, 576), (37, 64), (5, 1536), (3072, 576), (20, 18)]
ROWS = [1, 2, 5, 7, 33, 200]  # partial micro-tiles (6 rows), more than a pass (192 rows)
# relative to the largest output: float32 sums up to 1536 products in order (~sqrt(K) roundings)
TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 8e-3}


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def kernel_runs(dtype: torch.dtype) -> bool:
    lib = pl._library()
    return lib is not None and bool(lib.pdserve_skinny_supports(int(dtype == torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm_matches_float64(dtype, with_bias):
    """Where the kernel runs (AVX-512; AVX512-BF16 for bf16: this project's machines have
    both) it matches float64 to the dtype's rounding; elsewhere nothing is packed (None)."""
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        packed = skinny_pack(w)
        if not kernel_runs(dtype):
            assert packed is None
            continue
        assert packed.dtype == dtype and packed.numel() >= w.numel()
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            y = skinny_gemm(x, packed, b, n)
            assert y.shape == (rows, n) and y.dtype == dtype
            assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype], (n, k, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    """Each output is one sum over K in order, whatever the tiling: bit-identical alone and in
    batches of every size (a decode's token does not change with the batch it lands in)."""
    if not kernel_runs(dtype):
        pytest.skip(f"the kernel does not run {dtype} on this CPU")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(960, 576, generator=gen).to(dtype)
    packed = skinny_pack(w)
    x = torch.randn(200, 576, generator=gen).to(dtype)
    alone = torch.cat([skinny_gemm(x[i : i + 1], packed, None, 960) for i in range(200)])
    for rows in (2, 6, 7, 64, 200):
        assert torch.equal(skinny_gemm(x[:rows], packed, None, 960), alone[:rows]), rows


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_any_thread_count_splits_the_work_without_changing_a_bit(threads):
    """Threads split the column blocks, and with many rows and few blocks a thread the rows
    too (a grid of threads): every output is still the same one sum, bit for bit. N = 37 (3
    blocks: rows split), 160 (10 blocks: a 2 x 2 grid at 4 threads), 960 (blocks only)."""
    if not kernel_runs(torch.bfloat16):
        pytest.skip("the kernel does not run bf16 on this CPU")
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    for n in (37, 160, 960):
        w = torch.randn(n, 576, generator=gen).bfloat16()
        packed = skinny_pack(w)
        x = torch.randn(200, 576, generator=gen).bfloat16()
        alone = torch.cat([skinny_gemm(x[i : i + 1], packed, None, n) for i in range(200)])
        torch.set_num_threads(threads)
        try:
            y = skinny_gemm(x, packed, None, n)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(y, alone), n


def test_the_kernel_refuses_another_dtype():
    if not kernel_runs(torch.float32):
        pytest.skip("the kernel does not run here")
    packed = skinny_pack(torch.randn(32, 64))
    with pytest.raises(TypeError, match="bfloat16"):
        skinny_gemm(torch.randn(2, 64).bfloat16(), packed, None, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_operands_are_copied_and_kept_until_the_kernel_has_read_them(dtype):
    """A transposed weight, a strided bias and a strided x each get a contiguous copy: the
    kernel reads the copy, which must live until it returns (a freed one reads as garbage)."""
    if not kernel_runs(dtype):
        pytest.skip(f"the kernel does not run {dtype} on this CPU")
    gen = torch.Generator().manual_seed(9)
    for n, k in ((37, 64), (960, 576)):
        w = torch.randn(k, n, generator=gen).to(dtype).t()  # (N, K), not contiguous
        b = torch.randn(n, 2, generator=gen).to(dtype)[:, 0]  # every other value
        x = torch.randn(k, 5, generator=gen).to(dtype).t()
        packed = skinny_pack(w)
        for _ in range(3):
            y = skinny_gemm(x, packed, b, n)
            assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype], (n, k)


def test_the_kernel_refuses_an_x_or_bias_of_another_size():
    """The kernel trusts the sizes it is given: a K or a bias length other than the packed
    weight's is refused before it reads past either."""
    if not kernel_runs(torch.float32):
        pytest.skip("the kernel does not run here")
    w = torch.randn(37, 64)
    packed = skinny_pack(w)
    for k in (63, 65, 128):
        with pytest.raises(ValueError, match="K = 64"):
            skinny_gemm(torch.randn(2, k), packed, None, 37)
    with pytest.raises(ValueError, match="K = 64"):
        skinny_gemm(torch.randn(2, 1, 64), packed, None, 37)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(torch.randn(2, 64), packed, torch.randn(36), 37)
    if kernel_runs(torch.bfloat16):
        packed = skinny_pack(w.bfloat16())
        with pytest.raises(ValueError, match="K = 64"):
            skinny_gemm(torch.randn(2, 66).bfloat16(), packed, None, 37)
        assert skinny_gemm(torch.randn(2, 64).bfloat16(), packed, None, 37).shape == (2, 37)


def test_onednn_refuses_an_x_of_another_size_naming_it(monkeypatch):
    monkeypatch.setattr(pl, "_library", lambda: None)
    layer = PackedLinear(torch.randn(37, 64))
    with torch.inference_mode(), pytest.raises(ValueError, match="K = 64"):
        layer(torch.randn(2, 65))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_runs_the_kernel_at_every_row_count(monkeypatch, dtype):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no native {dtype} on this CPU: the layer is not packed")
    calls = []
    real = pl.skinny_gemm

    def counted(x, packed, b, n):
        calls.append(x.shape[0])
        return real(x, packed, b, n)

    monkeypatch.setattr(pl, "skinny_gemm", counted)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=gen).to(dtype), torch.randn(960, generator=gen).to(dtype)
    layer = PackedLinear(w, b)
    assert layer.skinny == kernel_runs(dtype)
    for rows in (1, 2, 3, 32, 300):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype]
    assert calls == ([1, 2, 3, 32, 300] if kernel_runs(dtype) else [])


def test_a_shape_the_kernel_does_not_pack_runs_onednn():
    """An odd K has no bf16 pairs: the layer packs for oneDNN instead."""
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN has no native bf16 on this CPU")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 75, generator=gen).bfloat16()
    assert skinny_pack(w) is None
    layer = PackedLinear(w)
    assert not layer.skinny
    x = torch.randn(3, 75, generator=gen).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    assert relative_error(y, reference(x, w, None)) < TOLERANCE[torch.bfloat16]


def test_without_the_kernel_onednn_runs_every_shape(monkeypatch):
    monkeypatch.setattr(pl, "_library", lambda: None)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(960, 576, generator=gen)
    assert skinny_pack(w) is None
    layer = PackedLinear(w)
    assert not layer.skinny
    for rows in (1, 32):
        x = torch.randn(rows, 576, generator=gen)
        with torch.inference_mode():
            y = layer(x)
        assert relative_error(y, reference(x, w, None)) < TOLERANCE[torch.float32]
