"""What `--dtype auto` means on this machine: bfloat16 where bf16 matmuls are fast, else float32.

CUDA: bfloat16. CPU: bfloat16 only when the CPU has native bf16 dot products (`avx512_bf16` or
`amx_bf16` in /proc/cpuinfo's flags; torch's own cpuinfo reading when /proc is unreadable) and
torch routes bf16 matmuls to oneDNN (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); float32
everywhere else. Neither check alone is enough: oneDNN reports bf16 "supported" on any AVX-512
CPU, where it emulates the dot products, and on CPUs of this project's kind without native bf16
a bf16 matmul measured ~60x slower than fp32, while with `avx512_bf16` it was 1.3-1.7x faster.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # native bf16 dot products
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the startup log


def choose_auto_dtype(device: str | torch.device) -> DtypeChoice:
    if torch.device(device).type == "cuda":
        return DtypeChoice(torch.bfloat16, "CUDA")
    return _choose_cpu_dtype(cpu_flags(), _onednn_bf16())


def _choose_cpu_dtype(flags: frozenset[str], onednn_bf16: bool) -> DtypeChoice:
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if not native:
        return DtypeChoice(
            torch.float32, "CPU without avx512_bf16/amx_bf16: bf16 matmuls would be emulated"
        )
    if not onednn_bf16:
        return DtypeChoice(
            torch.float32, f"CPU has {'+'.join(native)} but torch has no oneDNN bf16 kernels"
        )
    return DtypeChoice(torch.bfloat16, f"CPU has {'+'.join(native)} and oneDNN bf16 kernels")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo's, else torch's (cpuinfo library) reading."""
    try:
        return parse_cpuinfo_flags(CPUINFO.read_text())
    except OSError:
        caps = torch.cpu.get_capabilities()
        return frozenset(name for name, value in caps.items() if value is True)


def parse_cpuinfo_flags(text: str) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo's text (all cores report the same)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def _onednn_bf16() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or trimmed torch without the check
        return False
