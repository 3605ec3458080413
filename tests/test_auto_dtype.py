"""`--dtype auto`: bf16 on CUDA and on CPUs with native bf16 and oneDNN bf16 kernels, else fp32."""

from __future__ import annotations

import pytest
import torch

from common import auto_dtype
from common.auto_dtype import _choose_cpu_dtype, choose_auto_dtype, parse_cpuinfo_flags
from common.config import ModelConfig

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_parse_cpuinfo_flags():
    flags = parse_cpuinfo_flags(CPUINFO)
    assert "avx512_bf16" in flags and "avx512f" in flags and "sysret_ss_attrs" not in flags
    assert parse_cpuinfo_flags("processor\t: 0\n") == frozenset()


@pytest.mark.parametrize(
    ("flags", "onednn", "dtype", "why"),
    [
        ({"avx512f", "avx512_bf16"}, True, torch.bfloat16, "avx512_bf16 and oneDNN"),
        ({"amx_bf16", "avx512_bf16"}, True, torch.bfloat16, "amx_bf16+avx512_bf16"),
        ({"avx512f", "avx512bw", "avx512vl"}, True, torch.float32, "would be emulated"),
        ({"avx2"}, False, torch.float32, "without avx512_bf16/amx_bf16"),
        ({"avx512_bf16"}, False, torch.float32, "no oneDNN bf16 kernels"),
    ],
)
def test_cpu_choice(flags, onednn, dtype, why):
    choice = _choose_cpu_dtype(frozenset(flags), onednn)
    assert choice.dtype == dtype and why in choice.reason


def test_cuda_is_bf16_and_explicit_wins():
    assert choose_auto_dtype("cuda").dtype == torch.bfloat16
    assert ModelConfig(dtype="float32").dtype_choice.reason == "set explicitly"
    assert ModelConfig(dtype="bf16").torch_dtype == torch.bfloat16


def test_unreadable_cpuinfo_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(auto_dtype, "CPUINFO", tmp_path / "missing")
    auto_dtype.cpu_flags.cache_clear()
    try:
        caps = torch.cpu.get_capabilities()
        assert ("avx512_bf16" in auto_dtype.cpu_flags()) == bool(caps.get("avx512_bf16"))
    finally:
        auto_dtype.cpu_flags.cache_clear()


def test_this_machine_agrees_with_torch_and_the_kv_cache_follows(tiny_model):
    """On this machine the choice matches torch's reading of the CPU; the KV cache and the
    handshake's dtype are the model's."""
    from common.engine.llm import LLM

    caps = torch.cpu.get_capabilities()
    native = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    expected = torch.bfloat16 if native and auto_dtype._onednn_bf16() else torch.float32
    assert ModelConfig().torch_dtype == expected
    engine = LLM(str(tiny_model("llama")), num_blocks=16, max_model_len=64).engine
    assert {kv.dtype for kv in engine.kv_caches} == {expected}
    assert next(engine.model.parameters()).dtype == expected
