"""Linear layers with their weights packed once for a CPU GEMM kernel (CPU only).

MKL's GEMM on a row-major weight is slow for the skinny shapes of decoding (1–64 rows).
`pack_linears(model)` swaps each `nn.Linear` of the decoder layers for a `PackedLinear` that
keeps the original weight tensor and a packed copy of it (extra memory: as much again as the
weights), and runs its GEMM as a custom op, opaque to torch.compile:
- `pdserve::skinny_linear`, the C kernel in skinny_gemm.c, on a weight packed in blocks of 16
  output columns (the operand layout of AVX-512's bf16 dot product). From 1 to 128 rows it ran
  1.1–2.0x oneDNN's packed GEMM on this box, level with it from 256 to 2048 (docs/benchmarks.md,
  "Skinny GEMM"), and a row's result does not depend on the rows batched with it;
- `pdserve::packed_linear`, oneDNN on a weight reordered into its blocked layout (the packing
  torch's inductor applies when it freezes weights), where the kernel does not build or run
  (no compiler, no AVX-512, bf16 without AVX512-BF16).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from common.native.build import load_library

_PACK_BATCH_HINT = 32  # the row count oneDNN tunes the layout for; fine from 1 to 128 rows


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias  # shared, not copied
        self.out_features = weight.shape[0]
        packed = skinny_pack(weight)
        self.skinny = packed is not None
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny:
            return torch.ops.pdserve.skinny_linear(
                x, self.packed_weight, self.bias, self.out_features
            )
        return torch.ops.pdserve.packed_linear(x, self.packed_weight, self.bias, self.out_features)


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


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    _check_k(x, packed_weight.shape[1], "packed_linear")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("pdserve::skinny_linear", mutates_args=())
def _skinny_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return skinny_gemm(x, packed_weight, bias, out_features)


@_packed_linear.register_fake
@_skinny_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def skinny_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (N, K) packed for `skinny_gemm`: a flat tensor of its dtype; None where the
    kernel does not run (no kernel, another device or dtype, an odd K in bf16)."""
    lib = _library()
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
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias on `skinny_pack(weight)`. The kernel trusts every
    size it is given: x's K and the bias's length are checked against the packed weight's."""
    if x.dtype != packed_weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"skinny_gemm: x is {x.dtype}, the weight {packed_weight.dtype}")
    lib = _library()
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
    grows by a whole line of 16 columns per step of K, so one K gives it (None: none does)."""
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


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(Path(__file__).with_name("skinny_gemm.c"))
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
    return lib
