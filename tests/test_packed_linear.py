"""The linear layer of the compiled path on a CPU (common/model/packed_linear.py): the C kernel
in common/model/skinny_gemm.c on its packed weight where it runs, oneDNN on its own packed
weight elsewhere, and which one runs per row class. Every build of the kernel this CPU can run
(`march`: the native one, AVX-512 here, and x86-64-v3, the AVX2 + FMA code an AVX2-only CPU
builds) against float64; a row's result does not depend on the rows batched with it nor on the
thread count; without the kernel (or for a shape it does not pack) oneDNN runs."""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common.model.packed_linear as pl
from common.model.packed_linear import PackedLinear, can_pack, skinny_gemm, skinny_pack
from common.native import choice
from common.settings import MARCH_ENV

# N, K: N not a multiple of 16 or 8, K of 16 or 32 values, K long
SHAPES = [(960, 576), (37, 64), (5, 1536), (3072, 576), (20, 18)]
ROWS = [1, 2, 5, 7, 33, 200]  # partial micro-tiles (6 rows), more than a pass (192 rows)
# relative to the largest output: float32 sums up to 1536 products in order (~sqrt(K) roundings)
TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 8e-3}
# the instruction sets a build needs, as /proc/cpuinfo names them
NEEDS = {"native": set(), "x86-64-v3": {"avx2", "fma"}}
EXPECTED_ISA = {"x86-64-v3": "avx2"}


@cache
def cpu_flags() -> frozenset[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = [line for line in text.splitlines() if line.startswith("flags")]
    return frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset()


@pytest.fixture(params=list(NEEDS))
def march(request) -> str:
    """A build of the kernel this CPU runs; a build it cannot run is a skip, with the flags."""
    missing = NEEDS[request.param] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}: the {request.param} build cannot run")
    if pl._library(request.param) is None:
        compiler = shutil.which(os.environ.get("CC", "gcc"))
        if compiler is not None:  # a compiler that cannot build the kernel: a broken build
            pytest.fail(f"{compiler} did not build the {request.param} skinny_gemm.c (see the log)")
        pytest.skip(f"no C compiler (CC or gcc): the {request.param} build of skinny_gemm.c")
    return request.param


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def kernel_runs(dtype: torch.dtype, march: str = "native") -> bool:
    lib = pl._library(march)
    return lib is not None and bool(lib.pdserve_skinny_supports(int(dtype == torch.bfloat16)))


def require(dtype: torch.dtype, march: str) -> None:
    if not kernel_runs(dtype, march):
        pytest.skip(f"the {march} build ({pl.kernel_isa(march)}) does not run {dtype} here")


def test_each_build_says_which_code_it_runs(march):
    flags = cpu_flags()
    native = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "none"
    built = (os.environ.get(MARCH_ENV) or march) if march == "native" else march  # gcc's -march
    assert pl.kernel_isa(march) == EXPECTED_ISA.get(built, native)


def test_the_avx2_build_packs_no_bf16():
    """bf16 is AVX512-BF16 only: without native bf16 no layer is packed in bf16 (can_pack)."""
    if NEEDS["x86-64-v3"] - cpu_flags():
        pytest.skip("this CPU lacks avx2/fma: the x86-64-v3 build cannot run")
    assert not kernel_runs(torch.bfloat16, "x86-64-v3")
    assert skinny_pack(torch.randn(32, 64).bfloat16(), "x86-64-v3") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm_matches_float64(march, dtype, with_bias):
    require(dtype, march)
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        packed = skinny_pack(w, march)
        assert packed.dtype == dtype and packed.numel() >= w.numel()
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            y = skinny_gemm(x, packed, b, n, march)
            assert y.shape == (rows, n) and y.dtype == dtype
            assert relative_error(y, reference(x, w, b)) < TOLERANCE[dtype], (n, k, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(march, dtype):
    """Each output is one sum over K in order, whatever the tiling: bit-identical alone and in
    batches of every size (a decode's token does not change with the batch it lands in)."""
    require(dtype, march)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(960, 576, generator=gen).to(dtype)
    packed = skinny_pack(w, march)
    x = torch.randn(200, 576, generator=gen).to(dtype)
    alone = torch.cat([skinny_gemm(x[i : i + 1], packed, None, 960, march) for i in range(200)])
    for rows in (2, 3, 4, 6, 7, 64, 200):
        assert torch.equal(skinny_gemm(x[:rows], packed, None, 960, march), alone[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_any_thread_count_splits_the_work_without_changing_a_bit(march, dtype, threads):
    """Threads split the column blocks, and with many rows and few blocks a thread the rows
    too (a grid of threads): every output is still the same one sum, bit for bit. N = 37 (rows
    split), 160 (a 2 x 2 grid at 4 threads with 16-column blocks), 960 (blocks only)."""
    require(dtype, march)
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    for n in (37, 160, 960):
        w = torch.randn(n, 576, generator=gen).to(dtype)
        packed = skinny_pack(w, march)
        x = torch.randn(200, 576, generator=gen).to(dtype)
        alone = torch.cat([skinny_gemm(x[i : i + 1], packed, None, n, march) for i in range(200)])
        torch.set_num_threads(threads)
        try:
            y = skinny_gemm(x, packed, None, n, march)
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
    monkeypatch.setattr(pl, "_library", lambda march="native": None)
    layer = PackedLinear(torch.randn(37, 64))
    with torch.inference_mode(), pytest.raises(ValueError, match="K = 64"):
        layer(torch.randn(2, 65))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_runs_the_kernel_at_every_row_count(monkeypatch, dtype):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN has no native {dtype} on this CPU: the layer is not packed")
    calls = []
    real = pl.skinny_gemm

    def counted(x, packed, b, n, march="native"):
        calls.append(x.shape[0])
        return real(x, packed, b, n, march)

    monkeypatch.setattr(pl, "skinny_gemm", counted)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=gen).to(dtype), torch.randn(960, generator=gen).to(dtype)
    # the plan pinned to the kernel: the AVX2 build's own plan is timed against oneDNN (its own
    # test below), and the timing's calls would count here
    runs = kernel_runs(dtype)
    layer = PackedLinear(
        w, b, plan=(f"c-{pl.kernel_isa()}",) * len(pl.ROW_CLASSES) if runs else None
    )
    assert layer.skinny == runs
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
    monkeypatch.setattr(pl, "_library", lambda march="native": None)
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


def test_the_avx512_kernel_runs_every_row_class_untimed():
    """Where the native build is AVX-512 it runs every class (measured once, docs/benchmarks.md)
    and /health says so with the reason; no start-up timing."""
    if pl.kernel_isa() != "avx512":
        pytest.skip(f"the native build here is {pl.kernel_isa()}, not avx512")
    layer = PackedLinear(torch.randn(96, 64))
    assert layer.plan == ("c-avx512",) * 4 and layer.onednn_weight is None
    (kept,) = [c for c in choice.choices() if c.shape == "float32 96x64"]
    assert kept.path == "c-avx512" and "AVX-512" in kept.reason


def test_the_avx2_kernel_is_timed_against_onednn_per_row_class(march):
    """AVX2 code races oneDNN per row class on the layer's own shape; the layer keeps the packed
    copies its plan needs and is right at every class, whichever won."""
    if pl.kernel_isa(march) != "avx2":
        pytest.skip(f"the {march} build is {pl.kernel_isa(march)}: nothing is timed")
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    layer = PackedLinear(w, b, march=march)
    assert set(layer.plan) <= {"c-avx2", "onednn"}
    assert (layer.skinny_weight is None) == ("c-avx2" not in layer.plan)
    assert (layer.onednn_weight is None) == ("onednn" not in layer.plan)
    kept = {c.shape: c for c in choice.choices() if c.shape.startswith("float32 200x96 ")}
    assert sorted(kept) == sorted(f"float32 200x96 {pl.class_name(i)}" for i in range(4))
    for i, path in enumerate(layer.plan):
        chosen = kept[f"float32 200x96 {pl.class_name(i)}"]
        assert chosen.path == path
        assert set(chosen.timings_us) == {"c-avx2", "onednn"} or "second copy" in chosen.reason
    for rows in (1, 8, 32, 130):
        x = torch.randn(rows, 96, generator=gen)
        with torch.inference_mode():
            assert relative_error(layer(x), reference(x, w, b)) < TOLERANCE[torch.float32]


def test_a_plan_of_both_paths_runs_each_class_on_its_own(march, monkeypatch):
    """With both packed copies each row count runs the path of its class."""
    require(torch.float32, march)
    calls = []
    real = pl.skinny_gemm

    def counted(x, packed, b, n, march="native"):
        calls.append(x.shape[0])
        return real(x, packed, b, n, march)

    monkeypatch.setattr(pl, "skinny_gemm", counted)
    gen = torch.Generator().manual_seed(12)
    w, b = torch.randn(100, 64, generator=gen), torch.randn(100, generator=gen)
    c_path = f"c-{pl.kernel_isa(march)}"
    layer = PackedLinear(w, b, march=march, plan=(c_path, "onednn", c_path, "onednn"))
    rows_run = (1, 4, 5, 16, 17, 64, 65, 300)
    for rows in rows_run:
        x = torch.randn(rows, 64, generator=gen)
        with torch.inference_mode():
            assert relative_error(layer(x), reference(x, w, b)) < TOLERANCE[torch.float32]
    assert calls == [1, 4, 17, 64]


def test_a_second_packed_copy_is_kept_only_where_it_pays():
    """Mixed winners: a class that another path wins by little runs the main path (one copy);
    by more than SECOND_COPY_GAIN, each class keeps its winner (two copies)."""
    close = [{"c": 10.0, "o": 20.0}, {"c": 10.0, "o": 9.5}, {"c": 5.0, "o": 30.0}]
    assert pl._one_copy_unless_it_pays("t-close", close) == ("c", "c", "c")
    kept = {c.shape: c for c in choice.choices() if c.shape.startswith("t-close")}
    assert (
        kept["t-close rows 5-16"].path == "c" and "second copy" in kept["t-close rows 5-16"].reason
    )
    far = [{"c": 10.0, "o": 20.0}, {"c": 10.0, "o": 5.0}, {"c": 5.0, "o": 30.0}]
    assert pl._one_copy_unless_it_pays("t-far", far) == ("c", "o", "c")
    tie = [{"c": 10.0, "o": 20.0}, {"c": 30.0, "o": 10.0}]
    assert pl._one_copy_unless_it_pays("t-tie", tie) == ("c", "o")  # 200%: both copies
