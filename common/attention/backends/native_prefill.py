"""The CPU causal prefill attention kernel (native_prefill.c), built at start-up
(common/native/build.py).

`native_prefill()` returns a `NativePrefill` around the built library, or None where it could
not be built or loaded: the caller keeps SDPA. One call attends all of a step's prefill
sequences that have no cached prefix, each over its own new K/V. `NativePrefill.path` names the
code the library was built with: "c-avx512-bf16" (AVX-512, q.k's bf16 products on
`vdpbf16ps`, p.v in float32), "c-avx512" (AVX-512 without BF16: float32 vector code; bf16
inputs take the generic loops), "c-avx2" or "c-plain" (the generic C loops, vectorized by the
compiler for AVX2 and FMA, or not at all). `march` builds it for another instruction set than
this CPU's (tests and benchmarks check every path on one machine).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from common.native.build import load_library

SOURCE = Path(__file__).with_suffix(".c")
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's bounds; larger shapes keep SDPA
TILE = 32  # positions a packed K/V tile
PATHS = {3: "c-avx512-bf16", 2: "c-avx512", 1: "c-avx2", 0: "c-plain"}  # its init()'s answer


class NativePrefill:
    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.pdserve_prefill_attention
        fn.argtypes = [ptr] * 4 + [i64] * 4 + [ptr, ptr] + [i64] * 4
        fn.argtypes += [ctypes.c_float, ctypes.c_int, ptr, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._scratch_floats = lib.pdserve_prefill_attention_scratch
        self._scratch_floats.argtypes, self._scratch_floats.restype = [i64], i64
        self._pack_bytes = lib.pdserve_prefill_attention_pack_bytes
        self._pack_bytes.argtypes = [i64, i64, i64, ctypes.c_int]
        self._pack_bytes.restype = i64
        self._scratch = torch.empty(0)
        self._pack = torch.empty(0, dtype=torch.uint8)

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether the engine runs `dtype` on this build: bfloat16 on the AVX-512 BF16 code.
        NOTE: float32 keeps SDPA: the kernel is 1.2-1.8x SDPA there (2.6x in bf16), and
        its different rounding moved SmolLM2's fp32 logits 1.05e-4 off transformers', over
        test_smollm2.py's bound of the time (1e-4, now 2e-4; its error against float64 is no
        larger than SDPA's). Not tried in the engine since."""
        return self.path == "c-avx512-bf16" and dtype == torch.bfloat16

    @staticmethod
    def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
        """q (T, Hq, D), k (T, Hkv, D)."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16)
            and k.dtype == q.dtype
            and q.shape[1] % k.shape[1] == 0
            and q.shape[1] // k.shape[1] <= MAX_GROUP
            and q.shape[2] <= MAX_HEAD_DIM
            and q.shape[2] % 2 == 0
        )

    def __call__(self, q, k, v, seqs: PrefillSeqs, scale: float, out=None) -> torch.Tensor:
        """q (T, Hq, D); k, v (T, Hkv, D) of q's dtype, each head's D values contiguous and a
        token's heads one after the other (a row may be a view into a wider one); `seqs`: which
        tokens each sequence holds, each attending causally to its own K/V only. Returns
        (T, Hq, D) (`out` if given); rows no sequence holds are left as they were."""
        for t in (q, k, v):
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                raise TypeError("q, k and v must have contiguous heads of contiguous values")
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        heads, dim = q.shape[1:]
        kv_heads = k.shape[1]
        is_bf16 = int(q.dtype == torch.bfloat16)
        begin, end = seqs.begin, seqs.end
        threads = torch.get_num_threads()
        need = threads * self._scratch_floats(dim)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        pack = self._pack_bytes(seqs.num_tiles, kv_heads, dim, is_bf16)
        if self._pack.numel() < pack:
            self._pack = torch.empty(max(pack, 2 * self._pack.numel()), dtype=torch.uint8)
        rc = self._fn(
            q.data_ptr(),
            out.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            q.stride(0),
            k.stride(0),
            v.stride(0),
            out.stride(0),
            begin.data_ptr(),
            end.data_ptr(),
            begin.numel(),
            kv_heads,
            heads // kv_heads,
            dim,
            scale,
            is_bf16,
            self._pack.data_ptr(),
            self._scratch.data_ptr(),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"native prefill attention failed ({rc})")
        return out


@dataclass(frozen=True)
class PrefillSeqs:
    """The sequences of one call: sequence s is tokens [begin[s], end[s]) (contiguous int64
    tensors); `num_tiles` counts their K/V tiles of TILE positions. Made once a step by
    `prefill_seqs`, shared by all layers."""

    begin: torch.Tensor
    end: torch.Tensor
    num_tiles: int


def prefill_seqs(begin: list[int], end: list[int]) -> PrefillSeqs:
    num_tiles = sum(-(-(e - b) // TILE) for b, e in zip(begin, end, strict=True))
    return PrefillSeqs(
        torch.tensor(begin, dtype=torch.int64), torch.tensor(end, dtype=torch.int64), num_tiles
    )


def native_prefill(march: str = "native") -> NativePrefill | None:
    built = load(march)
    return None if built is None else NativePrefill(*built)


@cache
def load(march: str = "native") -> tuple[ctypes.CDLL, str] | None:
    """The built library and its path, or None (no compiler, a failed build): logged once."""
    lib = load_library(SOURCE, march)
    if lib is None:
        return None
    return lib, PATHS[lib.pdserve_prefill_attention_init()]
