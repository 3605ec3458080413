"""The CPU decode attention kernel (native_decode.c), built at start-up (common/native/build.py).

`native_decode()` returns a `NativeDecode` around the built library, or None where it could not
be built or loaded: the caller keeps its torch path. `NativeDecode.path` names the vector code
the library was built with ("c-avx512", "c-avx2", or "c-plain" for plain C loops); `march`
builds it for another instruction set than this CPU's (tests and benchmarks check every path
on one machine).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from common.native.build import load_library

SOURCE = Path(__file__).with_suffix(".c")
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's bounds; larger shapes keep the torch path
PATHS = {2: "c-avx512", 1: "c-avx2", 0: "c-plain"}  # pdserve_decode_attention_init()'s answer


class NativeDecode:
    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        fn = lib.pdserve_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 8 + [i64, ptr, ptr, ptr] + [i64] * 6 + [ctypes.c_float]
        fn.argtypes += [ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._scratch_floats = lib.pdserve_decode_attention_scratch
        self._scratch_floats.argtypes, self._scratch_floats.restype = [i64, i64], i64
        self._scratch = torch.empty(0)

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """q (T, Hq, D); kv_cache (2, blocks, block_size, Hkv, D)."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype == q.dtype
            and kv_cache.is_contiguous()
            and q.shape[1] // kv_cache.shape[3] <= MAX_GROUP
            and q.shape[2] <= MAX_HEAD_DIM
        )

    def __call__(
        self, q, k_flat, v_flat, table, lo, hi, block_size: int, max_len: int, scale, new=None
    ):
        """q (B, Hq, D) contiguous; k/v_flat (slots, Hkv, D) of the same dtype, contiguous;
        table (B, *) int64 block ids, rows contiguous; lo/hi (B,) int64: each context's
        positions [lo, hi), `max_len` >= every hi - lo. `new`: (k, v, slots), each sequence's
        own row (B, Hkv, D), written to the cache at `slots` (B,) int64 before it attends.
        Returns (B, Hq, D)."""
        k_new, v_new, slots = (None, None, None) if new is None else new
        ints = (table, lo, hi) if slots is None else (table, lo, hi, slots)
        contiguous = lo.is_contiguous() and hi.is_contiguous()
        if not (table.stride(-1) == 1 and contiguous) or any(t.dtype != torch.int64 for t in ints):
            raise TypeError("block table, lo and hi must be contiguous int64 tensors")
        if new is not None and not (
            k_new.dtype == v_new.dtype == q.dtype
            and k_new.shape == v_new.shape == (q.shape[0], *k_flat.shape[1:])
            and k_new.is_contiguous()
            and v_new.is_contiguous()
            and slots.is_contiguous()
        ):
            raise TypeError("new rows must be contiguous (B, Hkv, D) of q's dtype")
        batch, heads, dim = q.shape
        kv_heads = k_flat.shape[1]
        group = heads // kv_heads
        threads = torch.get_num_threads()
        need = threads * self._scratch_floats(group, max_len)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()))
        out = torch.empty_like(q)
        rc = self._fn(
            q.data_ptr(),
            out.data_ptr(),
            k_flat.data_ptr(),
            v_flat.data_ptr(),
            None if new is None else k_new.data_ptr(),
            None if new is None else v_new.data_ptr(),
            None if new is None else slots.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            lo.data_ptr(),
            hi.data_ptr(),
            self._scratch.data_ptr(),
            batch,
            kv_heads,
            group,
            dim,
            block_size,
            max_len,
            scale,
            int(q.dtype == torch.bfloat16),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"native decode attention failed ({rc})")
        return out


def native_decode(march: str = "native") -> NativeDecode | None:
    built = load(march)
    return None if built is None else NativeDecode(*built)


@cache
def load(march: str = "native") -> tuple[ctypes.CDLL, str] | None:
    """The built library and its path, or None (no compiler, a failed build): logged once."""
    lib = load_library(SOURCE, march)
    if lib is None:
        return None
    return lib, PATHS[lib.pdserve_decode_attention_init()]
