"""The C decode attention kernel (native_decode.c), each of its paths against float64, and the
start-up choice between it and the torch path (decode_choice.py).

Every path this CPU can run is built and checked: `-march=native` (AVX-512 here, or whatever
the CPU has), `x86-64-v3` (AVX2 and FMA, no AVX-512) and `x86-64-v2` (the plain C loops).
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import pytest
import torch

from common.attention.backends import decode_choice
from common.attention.backends.decode_choice import BATCH_CLASSES, batch_class
from common.attention.backends.native_decode import native_decode
from common.attention.backends.torch_paged import TorchPagedBackend, _attend_by_slot, _compiled
from common.native import choice

# what each instruction set needs of the CPU (/proc/cpuinfo flags), and the path it builds
MARCHES = {
    "native": (set(), None),
    "x86-64-v3": ({"avx2", "fma", "bmi2", "f16c", "movbe"}, "c-avx2"),
    "x86-64-v2": ({"sse4_2", "popcnt", "ssse3"}, "c-plain"),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags = next((line for line in text.splitlines() if line.startswith("flags")), ":")
    return set(flags.split(":", 1)[1].split())


def _march_params(*marches: str) -> list:
    """Each of `marches` (all by default), skipped where this CPU cannot run its code."""
    params = []
    for march in marches or MARCHES:
        needs = MARCHES[march][0]
        missing = sorted(needs - _cpu_flags())
        if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
            missing = ["an x86-64 CPU"]
        why = f"-march={march} cannot run here: this CPU lacks {', '.join(missing)}"
        params.append(pytest.param(march, marks=pytest.mark.skipif(bool(missing), reason=why)))
    return params


def checked_build(native, march: str):
    """A kernel `native_*(march)` built: it loaded, with the code `MARCHES` expects of it."""
    assert native is not None, f"the kernel did not build for -march={march}"
    want = MARCHES[march][1]
    assert want is None or native.path == want, f"-march={march} built {native.path}"
    return native


@cache
def _kernel(march: str):
    return checked_build(native_decode(march), march)


@cache
def _fused():
    return _compiled(_attend_by_slot)


def _tables(lens: list[int], block: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(B, max blocks) shuffled block ids, padded with 0; the cache's block count."""
    counts = [-(-n // block) for n in lens]
    ids = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    rows, at = [], 0
    for c in counts:
        rows.append(ids[at : at + c] + [0] * (max(counts) - c))
        at += c
    return torch.tensor(rows), sum(counts) + 3


def _reference(q, flat, table, lo, hi, block, scale) -> torch.Tensor:
    """float64 attention of each query over positions [lo, hi) of its context: (B, Hq, D)."""
    kv_heads, dim = flat.shape[2:]
    out = []
    for i in range(q.shape[0]):
        pos = torch.arange(int(lo[i]), int(hi[i]))
        slots = table[i, pos // block] * block + pos % block
        k, v = (flat[j, slots].double().transpose(0, 1) for j in (0, 1))  # (Hkv, L, D)
        qh = q[i].double().view(kv_heads, -1, dim)  # (Hkv, G, D)
        out.append((torch.softmax(qh @ k.transpose(1, 2) * scale, -1) @ v).reshape(-1, dim))
    return torch.stack(out)


@pytest.mark.parametrize("march", _march_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_native_decode_on_smollm2_shapes(march, dtype, sliding_window):
    """Each path on SmolLM2's heads (9 query heads on 3 KV heads, head dim 64: 16 positions
    scored at a time with AVX-512, 8 with AVX2) against float64, on contexts of 1 to 300
    positions (none a multiple of 16 but one) in shuffled blocks; and the same answer, to bf16
    rounding, as the compiled torch kernel."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    lens = [1, 15, 16, 17, 40, 129, 300]
    table, num_blocks = _tables(lens, block, gen)
    cache_ = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    hi = torch.tensor(lens)
    lo = hi.new_zeros(len(lens)) if sliding_window is None else (hi - sliding_window).clamp(min=0)
    flat = cache_.view(2, -1, kv_heads, dim)
    out = _kernel(march)(q, flat[0], flat[1], table, lo, hi, block, max(lens), scale)
    want = _reference(q, flat, table, lo, hi, block, scale)
    assert (out.double() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 1e-2)
    if dtype == torch.bfloat16:
        for i in range(len(lens)):
            pos = torch.arange(int(lo[i]), lens[i])
            slots = table[i, pos // block] * block + pos % block
            qh = q[i].view(1, kv_heads, -1, dim)
            other = _fused()(qh, flat[0], flat[1], slots[None], pos[:1] * 0,
                             pos[:1] * 0 + len(pos), scale)  # fmt: skip
            assert (out[i] - other.view(heads, dim)).double().abs().max().item() <= (
                2**-7 * want[i].abs().max()
            )


@pytest.mark.parametrize("march", _march_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    [(2, 1, 128), (1, 7, 48), (2, 4, 8), (1, 16, 256), (2, 2, 40)],
    ids=["mha-128", "g7-48", "g4-8", "g16-256", "g2-40"],
)
def test_native_decode_writes_the_new_rows_and_attends_to_them(march, dtype, kv_heads, group, dim):
    """Other head shapes (one query head a KV head up to 16; head dims the vector code takes
    whole, in part and not at all), a sliding window on one sequence: each sequence's own K/V
    row is written to its slot first, and attended to, as in a decode step."""
    block, scale = 8, dim**-0.5
    gen = torch.Generator().manual_seed(dim + group)
    lens = [1, 8, 9, 33, 70]
    table, num_blocks = _tables(lens, block, gen)
    cache_ = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(dtype)
    k_new, v_new = torch.randn(2, len(lens), kv_heads, dim, generator=gen).to(dtype)
    hi = torch.tensor(lens)
    lo = torch.tensor([0, 0, 0, 0, 50])  # the last one: a window of 20
    last = hi - 1
    slots = table.gather(1, (last // block)[:, None])[:, 0] * block + last % block
    flat = cache_.view(2, -1, kv_heads, dim)
    expected = flat.clone()
    expected[0, slots], expected[1, slots] = k_new, v_new
    out = _kernel(march)(
        q, flat[0], flat[1], table, lo, hi, block, max(lens), scale, (k_new, v_new, slots)
    )
    assert torch.equal(flat, expected)
    want = _reference(q, expected, table, lo, hi, block, scale)
    assert (out.double() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("march", _march_params("x86-64-v3"))  # the AVX2 build
def test_start_up_times_each_batch_class_and_records_the_choice(march):
    """Without AVX-512 the kernel is timed against the torch path at start-up: a choice with
    both timings is recorded for every batch class (/health "kernels")."""
    backend = TorchPagedBackend(True, native=True, march=march)
    kv_cache = torch.zeros(2, 4, 16, 3, 64)
    backend.choose_decode_paths(kv_cache, num_heads=9)
    kept = {c.shape: c for c in choice.choices() if c.kernel == decode_choice.KERNEL}
    for cls in BATCH_CLASSES:
        made = kept[cls.label(torch.float32)]
        assert set(made.timings_us) == {"c-avx2", "torch"}
        assert (made.path == "torch") == (cls in backend.torch_classes)


@pytest.mark.parametrize("march", _march_params("x86-64-v3"))
def test_each_batch_class_runs_the_path_chosen_for_it(march, monkeypatch):
    """The torch path forced for batches of 5-16: a step of 8 decodes runs torch's SDPA, steps
    of 2 and 20 the C kernel; both answers right, the new K/V rows written either way."""
    forced = batch_class(8)

    def choose(kernel, shape, candidates):
        return "torch" if shape == forced.label(torch.float32) else "c-avx2"

    monkeypatch.setattr(choice, "choose", choose)
    backend = TorchPagedBackend(True, native=True, march=march)
    backend.choose_decode_paths(torch.zeros(2, 4, 16, 3, 64), num_heads=9)
    assert backend.torch_classes == {forced}
    ran = []
    monkeypatch.setattr(backend, "_decode_c", _spy(backend._decode_c, "c", ran))
    monkeypatch.setattr(backend, "_decode_torch", _spy(backend._decode_torch, "torch", ran))
    for batch in (2, 8, 20):
        step = decode_choice.synthetic_step(torch.zeros(2, 1, 16, 3, 64), 9, batch)
        q, k, v, meta, scale = step.q, step.k, step.v, step.meta, 64**-0.5
        cache_ = torch.randn(2, meta.block_table.numel(), 16, 3, 64)
        out = backend.forward(q, k, v, cache_, meta, scale, None)
        flat = cache_.view(2, -1, 3, 64)
        assert torch.equal(flat[0, meta.slot_mapping], k)
        table, lo, hi = meta.block_table, meta.seq_lens_tensor * 0, meta.seq_lens_tensor
        want = _reference(q, flat, table, lo, hi, 16, scale)
        assert (out.double() - want).abs().max().item() < 1e-5
    assert ran == ["c", "torch", "c"]


def test_the_avx512_build_runs_without_timing():
    """Where -march=native builds the AVX-512 code, it is recorded with its reason, untimed."""
    backend = TorchPagedBackend(True, native=True)
    if backend.native.path != "c-avx512":
        pytest.skip(f"this CPU builds {backend.native.path}, not the AVX-512 code")
    backend.choose_decode_paths(torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16), 9)
    kept = {c.shape: c for c in choice.choices() if c.kernel == decode_choice.KERNEL}
    for cls in BATCH_CLASSES:
        made = kept[cls.label(torch.bfloat16)]
        assert made.path == "c-avx512" and not made.timings_us and "AVX-512" in made.reason
    assert not backend.torch_classes


def _spy(fn, name: str, ran: list[str]):
    def called(*args):
        ran.append(name)
        return fn(*args)

    return called
