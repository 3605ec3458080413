"""Attention backends against a dense float64 reference, and backend selection.

A batch is laid out as the model runner lays it out: decodes first, then prefill chunks, whose
cached prefix is already in the cache; block ids are shuffled and unused slots hold large noise,
so reading a wrong slot shows up in the output.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pytest
import torch

from common.attention.backends import native_decode as native_decode_module
from common.attention.backends import select_backend
from common.attention.backends.flash import FlashAttentionBackend
from common.attention.backends.torch_paged import TorchPagedBackend
from common.attention.metadata import AttentionMetadata
from common.kv_cache.tensors import bytes_per_block, num_blocks_for_memory
from common.model.hf_config import ArchConfig
from common.native import choice

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = HEAD_DIM**-0.5

# (cached tokens, new tokens) per sequence; a decode is (L - 1, 1).
MIXED = [(0, 1), (6, 1), (18, 1), (32, 1), (9, 6), (0, 11), (20, 3)]
DECODES_ONLY = [(4, 1), (0, 1), (25, 1)]
PREFILLS_ONLY = [(0, 7), (13, 5)]


@dataclass
class Batch:
    meta: AttentionMetadata
    query: torch.Tensor  # (T, Hq, D) new tokens only
    key: torch.Tensor  # (T, Hkv, D)
    value: torch.Tensor  # (T, Hkv, D)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D), prefixes already written
    expected_cache: torch.Tensor  # the cache once this step's K/V are written
    full: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per seq: q (Q), k, v (L)


def build_batch(seqs: list[tuple[int, int]], block_size: int, seed: int = 0) -> Batch:
    """The block layout depends only on (seqs, block_size), so batches built with different
    seeds share one metadata: like two layers of one step."""
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decodes first, as the model runner does
    lens = [cached + new for cached, new in seqs]
    tables, num_blocks = _block_tables(lens, block_size)
    gen = torch.Generator().manual_seed(seed)
    cache = 10 * torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    expected = cache.clone()
    full, slots = [], []
    for (cached, new), seq_len, table in zip(seqs, lens, tables):
        q = torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen)
        k, v = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(seq_len)])  # fmt: skip
        _put(cache, seq_slots[:cached], k[:cached], v[:cached])  # the cached prefix
        _put(expected, seq_slots, k, v)
        full.append((q, k, v))
        slots.append(seq_slots[cached:])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=[0, *itertools.accumulate(new for _, new in seqs)],
        seq_lens=lens,
        block_table=_padded(tables),
        seq_lens_tensor=torch.tensor(lens),
        num_decodes=sum(1 for _, new in seqs if new == 1),
        block_size=block_size,
        request_ids=[f"req-{i}" for i in range(len(seqs))],
    )
    new_k = torch.cat([k[cached:] for (cached, _), (_, k, _) in zip(seqs, full)])
    new_v = torch.cat([v[cached:] for (cached, _), (_, _, v) in zip(seqs, full)])
    query = torch.cat([q for q, _, _ in full])
    return Batch(meta, query, new_k, new_v, cache, expected, full)


def _block_tables(lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Shuffled block ids per sequence, and the cache's block count (three blocks to spare)."""
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3
    ids = iter(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(block_size)))
    return [[int(next(ids)) for _ in range(c)] for c in counts], num_blocks


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _put(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    flat[0, slots], flat[1, slots] = k, v


def reference_attention(q, k, v, sliding_window: int | None) -> torch.Tensor:
    """Dense softmax attention in float64: q (Q, Hq, D) are the last Q of k/v's L positions."""
    num_q, seq_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE  # (Hq, Q, L)
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def expected_output(batch: Batch, sliding_window: int | None) -> torch.Tensor:
    return torch.cat([reference_attention(q, k, v, sliding_window) for q, k, v in batch.full])


@pytest.mark.parametrize("seqs", [MIXED, DECODES_ONLY, PREFILLS_ONLY], ids=["mixed", "dec", "pre"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("decode", ["sdpa", "fused", "native"])
def test_torch_paged_matches_dense_reference(seqs, block_size, sliding_window, decode):
    backend = TorchPagedBackend(  # fused for any batch
        decode == "fused", fused_min_tokens=0, native=decode == "native"
    )
    assert (backend.native is not None) == (decode == "native")  # built on this machine
    layers = [build_batch(seqs, block_size, seed) for seed in (1, 2)]
    meta = layers[0].meta  # shared by both layers, as in one step (with its memo)
    for batch in layers:
        q, k, v = batch.query, batch.key, batch.value
        out = backend.forward(q, k, v, batch.kv_cache, meta, SCALE, sliding_window)
        assert out.shape == q.shape
        want = expected_output(batch, sliding_window)
        assert (out.double() - want).abs().max().item() < 1e-5
        assert torch.equal(batch.kv_cache, batch.expected_cache)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("decode", ["sdpa", "fused", "native"])
def test_decodes_with_only_a_bound_on_the_host(sliding_window, decode):
    """A captured decode's metadata (common/engine/decode_graphs.py): the Python `seq_lens`
    hold a bound, the lengths are only in `seq_lens_tensor`, and the block table is wider,
    its extra columns holding other valid block ids. The answer must not change."""
    backend = TorchPagedBackend(decode == "fused", fused_min_tokens=0, native=decode == "native")
    batch = build_batch(DECODES_ONLY, 4, seed=1)
    exact, bound = batch.meta, 64
    stale = torch.randint(0, batch.kv_cache.shape[1], (exact.num_seqs, bound // 4))
    stale[:, : exact.block_table.shape[1]] = exact.block_table
    meta = dataclasses.replace(exact, seq_lens=[bound] * exact.num_seqs, block_table=stale)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, meta, SCALE,
                          sliding_window)  # fmt: skip
    assert (out.double() - expected_output(batch, sliding_window)).abs().max().item() < 1e-5
    assert torch.equal(batch.kv_cache, batch.expected_cache)


def test_the_compiled_path_on_cpu_decodes_with_the_c_kernel(monkeypatch):
    """select_backend's choice for the engine's compiled path (not --enforce-eager) on a CPU:
    the torch backend with the C kernel built, which one call per layer runs for all of a
    step's decodes (prefills: test_native_prefill.py)."""
    backend = select_backend(torch.device("cpu"), torch.float32, 4, compiled=True)
    assert isinstance(backend, TorchPagedBackend) and backend.native is not None
    assert select_backend(torch.device("cpu"), torch.float32, 4).native is None  # eager
    calls = []
    real = backend.native

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(backend, "native", counted)
    monkeypatch.setattr(counted, "supports", real.supports, raising=False)
    batch = build_batch(MIXED, block_size=4)
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, SCALE, None
    )
    assert calls == [batch.meta.num_decodes]
    assert (out.double() - expected_output(batch, None)).abs().max().item() < 1e-5


def test_native_decode_refuses_what_it_would_misread():
    """The kernel reads int64 block ids by pointer: an int32 table is refused, not misread."""
    batch = build_batch(DECODES_ONLY, block_size=4)
    native = TorchPagedBackend(native=True).native
    flat = batch.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    hi = batch.meta.seq_lens_tensor
    q = batch.query[: batch.meta.num_decodes]
    with pytest.raises(TypeError, match="int64"):
        native(q, flat[0], flat[1], batch.meta.block_table.int(), hi * 0, hi, 4, 40, SCALE)


def test_without_a_compiler_the_compiled_kernel_decodes(monkeypatch, tmp_path):
    """No C compiler (CC names none): the kernel is not built, the compiled path keeps the
    torch.compile'd decode kernel, with the same answers, and says so."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))  # nothing built here before
    native_decode_module.load.cache_clear()
    try:
        backend = select_backend(torch.device("cpu"), torch.float32, 4, compiled=True)
    finally:
        native_decode_module.load.cache_clear()
    assert backend.native is None and backend._attend_by_slot is not None
    batch = build_batch(MIXED, block_size=4)
    backend.choose_decode_paths(batch.kv_cache, NUM_HEADS)  # shown in /health, with why
    made = {c.shape: c for c in choice.choices() if c.kernel == "decode_attention"}
    assert made["float32 batch 1-4"].path == "torch"
    assert made["float32 batch 17+"].reason == "no C compiler"
    backend.fused_min_tokens = 0
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, SCALE, None
    )
    assert (out.double() - expected_output(batch, None)).abs().max().item() < 1e-5
    assert not list(tmp_path.iterdir())  # nothing was built


def test_kv_lands_at_slot_mapping():
    batch = build_batch(MIXED, block_size=4)
    TorchPagedBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, SCALE, None
    )
    flat = batch.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[0, batch.meta.slot_mapping], batch.key)
    assert torch.equal(flat[1, batch.meta.slot_mapping], batch.value)


def test_batch_fixture_has_the_shapes_the_runner_builds():
    meta = build_batch(MIXED, block_size=4).meta
    assert meta.num_decodes == 4 and meta.num_seqs == 7
    assert [meta.query_len(i) for i in range(meta.num_seqs)] == [1, 1, 1, 1, 6, 11, 3]
    assert meta.seq_lens == [1, 7, 19, 33, 15, 11, 23]  # a prefix longer than its chunk
    assert meta.block_table.shape == (7, 9) and meta.block_table.dtype == torch.int64


def test_select_backend_on_cpu_is_torch():
    assert isinstance(select_backend(torch.device("cpu"), torch.float32, 16), TorchPagedBackend)
    assert isinstance(select_backend(torch.device("cpu"), torch.bfloat16, 16), TorchPagedBackend)
    chosen = select_backend(torch.device("cpu"), torch.float32, 4, name="torch")
    assert isinstance(chosen, TorchPagedBackend)


def test_select_flash_on_cpu_says_why():
    with pytest.raises(ValueError, match="'flash' cannot run here: device is cpu"):
        select_backend(torch.device("cpu"), torch.float16, 16, name="flash")


def test_select_unknown_backend():
    with pytest.raises(ValueError, match="must be one of \\['flash', 'torch'\\]"):
        select_backend(torch.device("cpu"), torch.float32, 16, name="xformers")


@pytest.mark.parametrize(
    ("device", "dtype", "block_size", "reason"),
    [
        ("cpu", torch.bfloat16, 16, "device is cpu, flash needs cuda"),
        ("cuda", torch.float32, 16, "dtype is torch.float32, flash needs float16 or bfloat16"),
        ("cuda", torch.bfloat16, 8, "block size 8 is not a multiple of 16"),
    ],
)
def test_flash_unsupported_reason(device, dtype, block_size, reason):
    assert FlashAttentionBackend.unsupported_reason(torch.device(device), dtype, block_size) == (
        reason
    )


def _arch(num_layers=30, num_kv_heads=3, head_dim=64) -> ArchConfig:
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=num_layers,
        num_heads=9,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        sliding_window=None,
        qkv_bias=False,
        qk_norm=False,
        bos_token_id=None,
        eos_token_ids=(2,),
    )


def test_block_memory_arithmetic():
    arch = _arch()
    per_block = 2 * 30 * 16 * 3 * 64 * 2  # K and V, layers, tokens, heads, dim, bf16 bytes
    assert bytes_per_block(arch, 16, torch.bfloat16) == per_block == 368_640
    assert bytes_per_block(arch, 16, torch.float32) == 2 * per_block
    assert num_blocks_for_memory(arch, 16, torch.bfloat16, 10 * per_block + per_block - 1) == 10
    assert num_blocks_for_memory(arch, 16, torch.bfloat16, per_block) == 1


def test_memory_for_no_block_is_an_error():
    with pytest.raises(ValueError, match="holds no block .*one block is 368640 bytes"):
        num_blocks_for_memory(_arch(), 16, torch.bfloat16, 368_639)


def test_flash_unsupported_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    why = FlashAttentionBackend.unsupported_reason(torch.device("cuda"), torch.bfloat16, 16)
    assert why == "torch sees no CUDA device"
