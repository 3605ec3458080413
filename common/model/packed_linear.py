"""Linear layers with their weights packed once for a CPU GEMM kernel (CPU only).

MKL's GEMM on a row-major weight is slow for the skinny shapes of decoding (1–64 rows).
`pack_linears(model)` swaps each `nn.Linear` of the decoder layers for a `PackedLinear` that
keeps the original weight tensor and a packed copy of it (extra memory: as much again as the
weights), and runs its GEMM as a custom op, opaque to torch.compile:
- `pdserve::skinny_linear`, the C kernel in skinny_gemm.c, on a weight packed in blocks of one
  register's output columns (16 with AVX-512: the operand layout of its bf16 dot product; 8 with
  AVX2). From 1 to 128 rows its AVX-512 code ran 1.03–1.68x oneDNN's packed GEMM on an AVX-512
  BF16 box (docs/benchmarks.md, "Skinny GEMM"), and a row's result does not depend on the rows
  batched with it;
- `pdserve::packed_linear`, oneDNN on a weight reordered into its blocked layout (the packing
  torch's inductor applies when it freezes weights), where the kernel does not build or run
  (no compiler, no AVX2, bf16 without AVX512-BF16, an odd K in bf16).

Which one runs is settled per layer shape and per class of row counts (`ROW_CLASSES`) when the
layer is packed, and recorded for `/health` (common/native/choice.py): the AVX-512 code runs
every class; the AVX2 code is timed against oneDNN on the layer's shape (at most
`TIMED_COLUMNS` output columns of it, one row count per class: ~0.1 s a shape on 2 cores) and
the faster runs. Both packed copies are kept (the weights' memory twice over instead of once)
only where each path wins a class by more than `SECOND_COPY_GAIN`; otherwise the path that wins
more classes (the fewest rows on a tie) runs every class, on one copy, and the others are
recorded with the gain left unused.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from common.native import choice
from common.native.build import load_library

_PACK_BATCH_HINT = 32  # the row count oneDNN tunes the layout for; fine from 1 to 128 rows
KERNEL = "skinny_gemm"
# (first, last) rows of a class, and the row count timed for it
ROW_CLASSES = ((1, 4), (5, 16), (17, 64), (65, None))
TIMED_ROWS = (1, 8, 32, 128)
TIMED_COLUMNS = 2048  # the columns of a layer's weight timed: enough to stream, cheap to pack
SECOND_COPY_GAIN = 0.15  # what a class must gain to keep a second packed copy of every weight
ONEDNN = "onednn"


class PackedLinear(nn.Module):
    """`plan`: the path per row class ("c-avx512", "c-avx2" or "onednn"); None: as settled for
    the weight's shape on this CPU (see the module's docstring)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        march: str = "native",
        plan: tuple[str, ...] | None = None,
    ):
        super().__init__()
        self.weight, self.bias = weight, bias  # shared, not copied
        self.out_features, self.march = weight.shape[0], march
        self.plan = plan or row_plan(weight, march)
        assert len(self.plan) == len(ROW_CLASSES), self.plan
        # bit i: class i runs the C kernel
        self.c_classes = sum(1 << i for i, path in enumerate(self.plan) if path != ONEDNN)
        self.skinny = self.c_classes != 0
        skinny = skinny_pack(weight, march) if self.skinny else None
        assert not self.skinny or skinny is not None, f"{self.plan}: the kernel does not pack"
        onednn = None
        if ONEDNN in self.plan:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.register_buffer("skinny_weight", skinny, persistent=False)
        self.register_buffer("onednn_weight", onednn, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn_weight is None:
            return torch.ops.pdserve.skinny_linear(
                x, self.skinny_weight, self.bias, self.out_features, self.march
            )
        if self.skinny_weight is None:
            return torch.ops.pdserve.packed_linear(
                x, self.onednn_weight, self.bias, self.out_features
            )
        return torch.ops.pdserve.chosen_linear(
            x,
            self.skinny_weight,
            self.onednn_weight,
            self.bias,
            self.out_features,
            self.c_classes,
            self.march,
        )


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """On CPU, float32 always; bfloat16 where oneDNN has native bf16 (AVX-512 BF16 or AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by a PackedLinear, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)


def row_class(rows: int) -> int:
    """The index in ROW_CLASSES of a GEMM of `rows` rows."""
    return next(i for i, (_, last) in enumerate(ROW_CLASSES) if last is None or rows <= last)


def class_name(index: int) -> str:
    first, last = ROW_CLASSES[index]
    return f"rows {first}+" if last is None else f"rows {first}-{last}"


def row_plan(weight: torch.Tensor, march: str = "native") -> tuple[str, ...]:
    """The path per row class for `weight` (N, K), recorded with why; timed once per shape."""
    isa = kernel_isa(march)
    n, k = weight.shape
    shape = f"{str(weight.dtype).removeprefix('torch.')} {n}x{k}"
    if skinny_pack(weight[:1], march) is None:
        why = "no C kernel built" if isa == "none" else f"the {isa} kernel does not run it"
        choice.record(KERNEL, shape, ONEDNN, why)
        return (ONEDNN,) * len(ROW_CLASSES)
    if isa == "avx512":
        choice.record(
            KERNEL, shape, "c-avx512", "AVX-512: 1.1-2.0x oneDNN from 1 to 128 rows, level above"
        )
        return ("c-avx512",) * len(ROW_CLASSES)
    return _timed_plan(min(n, TIMED_COLUMNS), k, weight.dtype, march, shape)


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    _check_k(x, packed_weight.shape[1], "packed_linear")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("pdserve::skinny_linear", mutates_args=())
def _skinny_linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    march: str = "native",
) -> torch.Tensor:
    return skinny_gemm(x, packed_weight, bias, out_features, march)


@torch.library.custom_op("pdserve::chosen_linear", mutates_args=())
def _chosen_linear(
    x: torch.Tensor,
    skinny_weight: torch.Tensor,
    onednn_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    c_classes: int,
    march: str = "native",
) -> torch.Tensor:
    """The C kernel for the row classes in the bit mask `c_classes`, oneDNN for the others."""
    if c_classes >> row_class(x.shape[0]) & 1:
        return skinny_gemm(x, skinny_weight, bias, out_features, march)
    return _packed_linear(x, onednn_weight, bias, out_features)


@_packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


@_skinny_linear.register_fake
def _(x, packed_weight, bias, out_features, march="native"):
    return x.new_empty(x.shape[0], out_features)


@_chosen_linear.register_fake
def _(x, skinny_weight, onednn_weight, bias, out_features, c_classes, march="native"):
    return x.new_empty(x.shape[0], out_features)


@cache
def _timed_plan(n: int, k: int, dtype: torch.dtype, march: str, shape: str) -> tuple[str, ...]:
    """Each row class timed on a random (n, k) weight: the C kernel against oneDNN."""
    gen = torch.Generator().manual_seed(0)  # not the global one: the model's seed stays
    weight = torch.randn(n, k, generator=gen).to(dtype)
    skinny = skinny_pack(weight, march)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    c_path = f"c-{kernel_isa(march)}"
    medians = []
    with torch.no_grad():
        for index, rows in enumerate(TIMED_ROWS):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            candidates = {
                c_path: lambda x=x: skinny_gemm(x, skinny, None, n, march),
                ONEDNN: lambda x=x: _packed_linear(x, onednn, None, n),
            }
            choice.choose(KERNEL, f"{shape} {class_name(index)}", candidates)
            medians.append(_timings(f"{shape} {class_name(index)}"))
    return _one_copy_unless_it_pays(shape, medians)


def _timings(shape: str) -> dict[str, float]:
    (kept,) = [c for c in choice.choices() if c.kernel == KERNEL and c.shape == shape]
    return kept.timings_us


def _one_copy_unless_it_pays(shape: str, medians: list[dict[str, float]]) -> tuple[str, ...]:
    """The faster path per class, or one path for all where a second copy would not pay."""
    winners = [min(t, key=t.__getitem__) for t in medians]
    paths = list(dict.fromkeys(winners))  # in order of first (fewest rows) win
    if len(paths) == 1:
        return tuple(winners)
    main = max(paths, key=winners.count)  # max keeps the first on a tie
    gains = [t[main] / t[w] - 1 for t, w in zip(medians, winners) if w != main]
    if max(gains) > SECOND_COPY_GAIN:
        return tuple(winners)
    for index, (t, w) in enumerate(zip(medians, winners)):
        if w != main:
            why = f"{w} {100 * (t[main] / t[w] - 1):.0f}% faster: not worth a second copy"
            choice.record(KERNEL, f"{shape} {class_name(index)}", main, why)
    return (main,) * len(winners)


def skinny_pack(weight: torch.Tensor, march: str = "native") -> torch.Tensor | None:
    """`weight` (N, K) packed for `skinny_gemm` (of the library built for `march`): a flat
    tensor of its dtype; None where the kernel does not run (no kernel, another device or
    dtype, an odd K in bf16)."""
    lib = _library(march)
    if lib is None or weight.device.type != "cpu" or weight.dtype not in _supported_dtypes(lib):
        return None
    n, k = weight.shape
    is_bf16 = int(weight.dtype == torch.bfloat16)
    size = lib.pdserve_skinny_packed_bytes(n, k, is_bf16) // weight.element_size()
    if size == 0:
        return None
    packed = weight.new_empty(size)
    weight = weight.detach().contiguous()  # NOTE: named, so a copy outlives the C call
    lib.pdserve_skinny_pack(weight.data_ptr(), packed.data_ptr(), n, k, is_bf16)
    return packed


def skinny_gemm(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    march: str = "native",
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias on `skinny_pack(weight, march)`. The kernel trusts
    every size it is given: x's K and the bias's length are checked against the packed weight's."""
    if x.dtype != packed_weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"skinny_gemm: x is {x.dtype}, the weight {packed_weight.dtype}")
    lib = _library(march)
    _check_k(x, _packed_k(lib, packed_weight, out_features), "skinny_gemm")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"skinny_gemm: a bias of {tuple(bias.shape)} for {out_features} outputs")
    # NOTE: named, so that the copies .contiguous() may make outlive the C call
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    rc = lib.pdserve_skinny_gemm(
        x.data_ptr(),
        packed_weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        out_features,
        x.shape[1],
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"skinny_gemm: the kernel refused {tuple(x.shape)} x {out_features}")
    return y


def _packed_k(lib: ctypes.CDLL, packed_weight: torch.Tensor, out_features: int) -> int | None:
    """The K that `skinny_pack` packed `packed_weight` for, N = `out_features`: its size
    grows by a whole line of columns per step of K, so one K gives it (None: none does)."""
    is_bf16 = int(packed_weight.dtype == torch.bfloat16)
    per_k = lib.pdserve_skinny_packed_bytes(out_features, 2 if is_bf16 else 1, is_bf16)
    num_bytes = packed_weight.numel() * packed_weight.element_size()
    if per_k <= 0 or packed_weight.dim() != 1 or num_bytes % per_k:
        return None
    return num_bytes // per_k * (2 if is_bf16 else 1)


def _check_k(x: torch.Tensor, k: int | None, op: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x of {tuple(x.shape)} for a weight of K = {k}")


@cache
def _supported_dtypes(lib: ctypes.CDLL) -> tuple[torch.dtype, ...]:
    """What the kernel runs on this CPU."""
    dtypes = (torch.float32, torch.bfloat16)
    return tuple(d for d in dtypes if lib.pdserve_skinny_supports(int(d == torch.bfloat16)))


def kernel_isa(march: str = "native") -> str:
    """The code the kernel built for `march` runs: "avx512", "avx2" or "none"."""
    lib = _library(march)
    return "none" if lib is None else lib.pdserve_skinny_isa().decode()


@cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    lib = load_library(Path(__file__).with_name("skinny_gemm.c"), march)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_skinny_gemm.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int, ctypes.c_int]
    lib.pdserve_skinny_gemm.restype = ctypes.c_int
    lib.pdserve_skinny_pack.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    lib.pdserve_skinny_pack.restype = None
    lib.pdserve_skinny_packed_bytes.argtypes = [i64, i64, ctypes.c_int]
    lib.pdserve_skinny_packed_bytes.restype = i64
    lib.pdserve_skinny_supports.argtypes = [ctypes.c_int]
    lib.pdserve_skinny_supports.restype = ctypes.c_int
    lib.pdserve_skinny_isa.argtypes = []
    lib.pdserve_skinny_isa.restype = ctypes.c_char_p
    return lib
