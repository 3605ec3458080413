"""The CPU decode attention kernel (native_decode.c), built with the system's C compiler.

`load()` compiles the C file once per source and CPU (`gcc -O3 -march=native -fopenmp`) into
`$PDSERVE_CACHE_DIR/kernels` (~1 s; the compose files keep that folder in their cache volume)
and returns a `NativeDecode`, or None where there is no compiler or the build fails: the caller
keeps its torch path. The library links the libgomp that torch loaded (same soname), so its
threads are torch's OpenMP pool, not a second one competing for the cores; ctypes drops the GIL
for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from common.model.default_model import cache_dir

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's bounds; larger shapes keep the torch path

logger = logging.getLogger(__name__)


class NativeDecode:
    def __init__(self, lib: ctypes.CDLL):
        fn = lib.pdserve_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 5 + [i64, ptr, ptr, ptr] + [i64] * 6 + [ctypes.c_float]
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

    def __call__(self, q, k_flat, v_flat, table, lo, hi, block_size: int, max_len: int, scale):
        """q (B, Hq, D) contiguous; k/v_flat (slots, Hkv, D) of the same dtype, contiguous;
        table (B, *) int64 block ids, rows contiguous; lo/hi (B,) int64: each context's
        positions [lo, hi), `max_len` >= every hi - lo. Returns (B, Hq, D)."""
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in (table[0], lo, hi)):
            raise TypeError("block table, lo and hi must be contiguous int64 tensors")
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


def native_decode() -> NativeDecode | None:
    lib = load()
    return None if lib is None else NativeDecode(lib)


@cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (no compiler, a failed build): logged once."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("no C compiler: decode attention keeps the torch kernel")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_id()).hexdigest()
    target = cache_dir() / "kernels" / f"native_decode-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                logger.warning("decode attention kernel did not build:\n%s", run.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: another process may be building it too
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        logger.warning("decode attention kernel did not load: %s", e)
        return None
    lib.pdserve_decode_attention_init()
    return lib


def _cpu_id() -> bytes:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()
