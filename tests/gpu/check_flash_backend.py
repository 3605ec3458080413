"""GPU check: the flash backend against the torch paged backend (the CPU-tested reference).

Needs CUDA (sm80+) and vllm-flash-attn or vLLM; not collected by pytest. From the repo root:
    python tests/gpu/check_flash_backend.py
(`python -m tests.gpu.check` runs it too, as its "flash" part.)
Each case runs one mixed batch (decodes, prefill chunks with and without a cached prefix) through
both backends on identical inputs and separate cache copies, and compares the outputs with each
other and with the torch backend in float32, and the caches they wrote. Then it times both on a
decode batch of 64 sequences x 2048 tokens of context.
Exit code: 0 all pass, 1 a check failed, 2 this machine cannot run the check.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.attention.backends.flash import FlashAttentionBackend  # noqa: E402
from common.attention.backends.torch_paged import TorchPagedBackend  # noqa: E402
from common.attention.metadata import AttentionMetadata  # noqa: E402

# (cached tokens, new tokens) per sequence: decodes have one new token.
MIXED = [(0, 1), (16, 1), (299, 1), (999, 1), (2048, 1), (100, 37), (0, 200), (513, 64), (16, 16)]
DEVICE = torch.device("cuda")
# (rtol, atol) as torch.allclose: about two units in the last place for outputs of size ~1
TOLERANCE = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@dataclass
class Inputs:
    meta: AttentionMetadata
    query: torch.Tensor  # (T, Hq, D)
    key: torch.Tensor  # (T, Hkv, D)
    value: torch.Tensor  # (T, Hkv, D)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D); noise stands in for prefixes


def build_meta(seqs, block_size: int, device: torch.device) -> tuple[AttentionMetadata, int]:
    """Metadata as the model runner builds it (decodes first, block table padded with 0),
    over shuffled block ids; returns it and the number of cache blocks."""
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    lens = [cached + new for cached, new in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    ids = torch.randperm(num_blocks).tolist()
    tables, slots, starts = [], [], [0]
    for (cached, new), seq_len in zip(seqs, lens):
        table, ids = ids[: -(-seq_len // block_size)], ids[-(-seq_len // block_size) :]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, seq_len)
        ]
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots),
        query_start_loc=starts,
        seq_lens=lens,
        block_table=tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens_tensor=tensor(lens),
        num_decodes=sum(1 for _, new in seqs if new == 1),
        block_size=block_size,
        request_ids=[f"req-{i}" for i in range(len(seqs))],
    )
    return meta, num_blocks


def build_inputs(seqs, block_size, heads, dtype, device) -> Inputs:
    num_heads, num_kv_heads, head_dim = heads
    meta, num_blocks = build_meta(seqs, block_size, device)
    num_tokens = meta.query_start_loc[-1]

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    return Inputs(
        meta,
        randn(num_tokens, num_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim),
        randn(num_tokens, num_kv_heads, head_dim),
        randn(2, num_blocks, block_size, num_kv_heads, head_dim),
    )


def run(backend, x: Inputs, sliding_window, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache written) of one forward on a copy of the cache, optionally upcast."""
    dtype = dtype or x.query.dtype
    cache = x.kv_cache.to(dtype, copy=True)
    q, k, v = (t.to(dtype) for t in (x.query, x.key, x.value))
    scale = q.shape[-1] ** -0.5
    out = backend.forward(q, k, v, cache, x.meta, scale, sliding_window)
    return out, cache


def check_case(flash, dtype, block_size, sliding_window, heads) -> tuple[str, bool]:
    x = build_inputs(MIXED, block_size, heads, dtype, DEVICE)
    torch_out, torch_cache = run(TorchPagedBackend(), x, sliding_window)
    exact, _ = run(TorchPagedBackend(), x, sliding_window, torch.float32)
    flash_out, flash_cache = run(flash, x, sliding_window)
    assert flash_out.shape == x.query.shape, f"output shape {tuple(flash_out.shape)}"
    vs_torch = (flash_out.float() - torch_out.float()).abs().max().item()
    vs_fp32 = (flash_out.float() - exact).abs().max().item()
    torch_vs_fp32 = (torch_out.float() - exact).abs().max().item()
    same_kv = torch.equal(flash_cache, torch_cache)
    rtol, atol = TOLERANCE[dtype]
    close = all(
        torch.allclose(flash_out.float(), ref.float(), rtol=rtol, atol=atol)
        for ref in (torch_out, exact)
    )
    ok = same_kv and close
    kv = "same" if same_kv else "DIFF"
    row = f"{vs_torch:>11.2e} {vs_fp32:>11.2e} {torch_vs_fp32:>11.2e}  {kv}"
    return row, ok


def check_all(flash) -> list[dict]:
    """Print a table of every case; one dict per case (name, row, ok)."""
    print(f"{'case':<36} {'flash-torch':>11} {'flash-fp32':>11} {'torch-fp32':>11}  kv    result")
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for block_size in (16, 32):
            for sliding_window in (None, 48):
                for heads in ((8, 2, 128), (9, 3, 64)):
                    name = (
                        f"{str(dtype)[6:]} bs={block_size} win={sliding_window} "
                        f"heads={heads[0]}/{heads[1]}x{heads[2]}"
                    )
                    try:
                        row, ok = check_case(flash, dtype, block_size, sliding_window, heads)
                    except Exception as e:  # noqa: BLE001 — report every case, then fail
                        row, ok = f"error: {type(e).__name__}: {e}", False
                    cases.append({"case": name, "row": row, "ok": ok})
                    print(f"{name:<36} {row}  {'PASS' if ok else 'FAIL'}")
    return cases


def time_ms(backend, x: Inputs, iters: int = 20) -> float:
    scale = x.query.shape[-1] ** -0.5
    for _ in range(3):
        backend.forward(x.query, x.key, x.value, x.kv_cache, x.meta, scale, None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        backend.forward(x.query, x.key, x.value, x.kv_cache, x.meta, scale, None)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_decode(flash) -> dict[str, float]:
    """Milliseconds per layer call of each backend on a large decode batch."""
    heads = (32, 8, 128)  # a Llama-3-8B layer
    x = build_inputs([(2047, 1)] * 64, 16, heads, torch.bfloat16, DEVICE)
    kv_bytes = 2 * 64 * 2048 * heads[1] * heads[2] * 2
    print(f"\ndecode 64 x 2048 context, heads {heads}, bf16, block 16 (per layer call):")
    timings = {}
    for backend in (flash, TorchPagedBackend()):
        ms = timings[backend.name] = time_ms(backend, x)
        print(f"  {backend.name:<32} {ms:8.3f} ms  {kv_bytes / ms / 1e6:8.1f} GB/s of KV read")
    return timings


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA: torch sees no GPU here (run this on a CUDA machine)", file=sys.stderr)
        return 2
    why = FlashAttentionBackend.unsupported_reason(DEVICE, torch.bfloat16, 16)
    if why:
        print(f"needs a usable flash attention: {why}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    flash = FlashAttentionBackend()
    print(f"{flash.name} on {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    ok = all(case["ok"] for case in check_all(flash))
    time_decode(flash)
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
