"""Flash attention over the paged cache (vllm-flash-attn, or vLLM's bundled copy), CUDA only.

One varlen call covers the whole batch (decodes and prefill chunks): K/V are read through the
block table, so nothing is gathered. Chosen only when the package imports and the device,
dtype and block size fit; everywhere else the torch backend runs.
"""

from __future__ import annotations

import torch

from common.attention.backends.base import AttentionBackend, write_kv
from common.attention.metadata import AttentionMetadata


def _import_flash():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, "vllm.vllm_flash_attn"
    except Exception:  # noqa: BLE001 — any import failure means "not available"
        pass
    try:
        from vllm_flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, "vllm_flash_attn"
    except Exception as e:  # noqa: BLE001
        return None, f"vllm-flash-attn does not import ({type(e).__name__}: {e})"


class FlashAttentionBackend(AttentionBackend):
    name = "flash"

    def __init__(self) -> None:
        self._fn, self._source = _import_flash()
        assert self._fn is not None, self._source
        self.name = f"flash ({self._source})"
        # NOTE: vLLM's bundled kernels read each context up to its own length (`seqused_k`)
        # under a replayed graph, whatever max_seqlen_k the capture saw (its split-KV kernel
        # once read the Python bound there); the standalone package may predate that fix
        self.decode_graphs = self._source == "vllm.vllm_flash_attn"

    @classmethod
    def unsupported_reason(cls, device, dtype, block_size) -> str | None:
        if torch.device(device).type != "cuda":
            return f"device is {device}, flash needs cuda"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype is {dtype}, flash needs float16 or bfloat16"
        if block_size % 16:
            return f"block size {block_size} is not a multiple of 16"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:  # NOTE: FlashAttention-2 kernels exist for Ampere (sm80) and newer only
            return f"GPU compute capability is {major}.{minor}, flash needs 8.0 or newer"
        fn, why = _import_flash()
        return None if fn is not None else why

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta.slot_mapping)
        device = query.device
        cu_q = meta.query_start_loc_tensor
        if cu_q is None:
            cu_q = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
        seq_lens = meta.seq_lens_tensor.to(torch.int32)
        max_q = max(meta.query_len(i) for i in range(meta.num_seqs))
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        kwargs = dict(
            q=query,
            k=kv_cache[0],
            v=kv_cache[1],
            cu_seqlens_q=cu_q,
            max_seqlen_q=max_q,
            max_seqlen_k=max(meta.seq_lens),
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=meta.block_table.to(torch.int32),
        )
        if self._source == "vllm.vllm_flash_attn":
            kwargs["seqused_k"] = seq_lens
        else:
            cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=device)
            cu_k[1:] = torch.cumsum(seq_lens, 0)
            kwargs["cu_seqlens_k"] = cu_k
        return self._fn(**kwargs)
