"""Linear layers with their weights pre-packed for oneDNN (CPU only).

MKL's GEMM on a row-major weight is slow for the skinny shapes of decoding (8–32 rows); oneDNN
on a weight reordered once into its blocked layout runs them 2–3× faster on this CPU in float32
and 1.5–1.9× faster in bfloat16, bit-identical in bf16 (the packing torch's inductor applies
when it freezes weights). `pack_linears(model)` swaps each
`nn.Linear` of the decoder layers for a `PackedLinear` that keeps the original weight tensor
(the packed copy is extra memory: as much again as the weights); the GEMM is the custom op
`pdserve::packed_linear`, opaque to torch.compile.

At 1–2 rows (a decode step of one or two sequences; the compiled forward pads one to two) the
op runs the C kernel in gemv.c on the original weight instead: there a GEMM only streams its
weight, and oneDNN's packed kernel read it at about half this box's memory rate
(docs/benchmarks.md, "GEMV"). Where the kernel cannot build, oneDNN runs every shape.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from common.native.build import load_library

_PACK_BATCH_HINT = 32  # the row count oneDNN tunes the layout for; fine from 1 to 128 rows
GEMV_MAX_ROWS = 2  # at 4 rows oneDNN is as fast, at 8 faster


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias  # shared, not copied
        self.out_features = weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        _gemv_library()  # built now, at start-up, not on the first request

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.packed_linear(
            x, self.weight, self.packed_weight, self.bias, self.out_features
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


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    if x.shape[0] <= GEMV_MAX_ROWS and (y := gemv(x, weight, bias)) is not None:
        return y
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@_packed_linear.register_fake
def _(x, weight, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x (M, K) @ weight (N, K)^T + bias with the C kernel; None where it does not run (no
    kernel, a dtype or shape it does not take: the caller runs oneDNN)."""
    lib = _gemv_library()
    if lib is None or x.dtype != weight.dtype or x.dtype not in _supported_dtypes(lib):
        return None
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    x = x.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    rc = lib.pdserve_gemv(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


@cache
def _supported_dtypes(lib: ctypes.CDLL) -> tuple[torch.dtype, ...]:
    """What the kernel runs on this CPU: asked once, not on every call."""
    dtypes = (torch.float32, torch.bfloat16)
    return tuple(d for d in dtypes if lib.pdserve_gemv_supports(int(d == torch.bfloat16)))


@cache
def _gemv_library() -> ctypes.CDLL | None:
    lib = load_library(Path(__file__).with_name("gemv.c"))
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_gemv.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int, ctypes.c_int]
    lib.pdserve_gemv.restype = ctypes.c_int
    lib.pdserve_gemv_supports.argtypes = [ctypes.c_int]
    lib.pdserve_gemv_supports.restype = ctypes.c_int
    lib.pdserve_gemv_init()
    return lib
