"""Pure-torch paged attention: runs on any device; the reference for other backends.

Decodes (one query each) are batched: their blocks are gathered into a padded (B, L) context
and masked by length. Prefill chunks run one sequence at a time with a bottom-right causal mask
over cached prefix + new tokens; a chunk with no cached prefix attends to its own K/V directly.

With `native` (the engine's compiled path on a CPU), a step's decodes run as one call of the
C kernel in native_decode.c: it writes each decode's own K/V row, reads each context from the
cache by slot, prefetching rows ahead, scores 16 positions at a time and accumulates in
float32 (docs/benchmarks.md, "Decode attention in C"). A shape it does not take (more than 16
query heads a KV head) falls back to SDPA. Where the kernel was built without AVX-512 (its AVX2
or plain code), `warm_up` times it against the torch path per batch size class and each class
runs the faster (decode_choice.py). Without it (no C compiler, a failed build),
`compiled_decode` runs a step's decodes with enough context (`FUSED_MIN_TOKENS`) as one
torch.compile'd kernel that reads each context by slot inside two float32 reductions: no
gathered copy of K/V, no mask tensor (up to 1.5x SDPA on the gathered context in bf16, 3.9x in
fp32, at batch 32). Eager (`--enforce-eager`) keeps SDPA.

With `native`, a step's prefill sequences that have no cached prefix (and no sliding window)
run as one call of the C kernel in native_prefill.c: causal attention of each over its own new
K/V, OpenMP sharing (sequence, KV head, query block) items out, bf16 products on `vdpbf16ps`
(benchmarks/kernels/bench_prefill_attention.py). The engine runs it in bfloat16 on its AVX-512 BF16
code only (`NativePrefill.takes`): float32, and builds without AVX-512 BF16 (whose generic C
code is tested, not measured against SDPA), keep SDPA per sequence, recorded without timing.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from common.attention.backends import decode_choice
from common.attention.backends.base import AttentionBackend, write_kv
from common.attention.backends.decode_choice import BATCH_CLASSES, BatchClass, batch_class
from common.attention.backends.native_decode import SOURCE, NativeDecode, native_decode
from common.attention.backends.native_prefill import NativePrefill, native_prefill, prefill_seqs
from common.attention.metadata import AttentionMetadata
from common.native import choice
from common.native.build import library_path


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self,
        compiled_decode: bool = False,
        fused_min_tokens: int | None = None,
        native: bool = False,
        march: str = "native",
    ):
        """`march`: the instruction set the C kernel is built for (another than this CPU's in
        tests and benchmarks)."""
        self.compiled_decode = compiled_decode
        self.fused_min_tokens = FUSED_MIN_TOKENS if fused_min_tokens is None else fused_min_tokens
        self.native_march = march if native else None
        self.native: NativeDecode | None = native_decode(march) if native else None  # built now
        self.native_prefill: NativePrefill | None = native_prefill(march) if native else None
        # the batch classes the torch path serves instead of the C kernel, once measured
        self.torch_classes: frozenset[BatchClass] = frozenset()
        # compiled unless only the AVX-512 kernel runs: the AVX2 one is timed against it
        fused = compiled_decode and (self.native is None or self.native.path != "c-avx512")
        self._attend_by_slot = _compiled(_attend_by_slot) if fused else None

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
        nd = meta.num_decodes
        if meta.num_tokens > nd:  # the prefill rows; each decode path writes its own
            write_kv(kv_cache, key[nd:], value[nd:], meta.slot_mapping[nd:])
        if nd:
            native = self._runs_native(query, kv_cache, nd)
            decode = self._decode_c if native else self._decode_torch
            dec = decode(query[:nd], key[:nd], value[:nd], kv_cache, meta, scale, sliding_window)
            if nd == meta.num_tokens:
                return dec
        out = torch.empty_like(query)
        if nd:
            out[:nd] = dec
        done = self._prefill_native(query, key, value, meta, scale, sliding_window, out)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if i in done:
                continue
            if meta.seq_lens[i] == end - start:  # no cached prefix: attend to the new K/V
                k, v = key[start:end], value[start:end]
            else:
                k, v = _gather_one(kv_cache, meta.block_table[i], meta.seq_lens[i])
            out[start:end] = _prefill(query[start:end], k, v, scale, sliding_window)
        return out

    def warm_up(self, kv_caches: list[torch.Tensor], num_heads: int) -> None:
        """Compile the decode kernel, then choose between it and the C kernel per batch class
        (`choose_decode_paths`); record which prefill attention runs."""
        self._compile_fused(kv_caches, num_heads)
        self.choose_decode_paths(kv_caches[0], num_heads)
        self.record_prefill_path(kv_caches[0].dtype)

    def record_prefill_path(self, dtype: torch.dtype) -> None:
        """Which prefill attention runs (common/native/choice.py), without timing: the C
        kernel's AVX-512 BF16 code in bfloat16, else SDPA."""
        if self.native_march is None:
            return
        native, label = self.native_prefill, str(dtype).removeprefix("torch.")
        if native is None:
            choice.record(PREFILL_KERNEL, label, "torch", "C kernel not built or not loaded")
        elif native.takes(dtype):
            choice.record(PREFILL_KERNEL, label, native.path, "AVX-512 BF16 build, kept untimed")
        else:
            choice.record(PREFILL_KERNEL, label, "torch", f"{native.path} build: SDPA in {label}")

    def _prefill_native(self, query, key, value, meta, scale, sliding_window, out) -> frozenset:
        """The prefill sequences without a cached prefix, by the C kernel into `out` in one
        call where it runs this shape; returns their indices (none where it does not)."""
        native, nd = self.native_prefill, meta.num_decodes
        if native is None or sliding_window is not None or meta.num_tokens == nd:
            return frozenset()
        if not (native.takes(query.dtype) and native.supports(query, key)):
            return frozenset()
        if "prefill" not in meta.memo:  # once a step, shared by all layers
            loc = meta.query_start_loc
            new = [i for i in range(nd, meta.num_seqs) if meta.seq_lens[i] == meta.query_len(i)]
            seqs = prefill_seqs([loc[i] for i in new], [loc[i + 1] for i in new]) if new else None
            meta.memo["prefill"] = (frozenset(new), seqs)
        done, seqs = meta.memo["prefill"]
        if done:
            native(query, key, value, seqs, scale, out=out)
        return done

    def choose_decode_paths(self, kv_cache: torch.Tensor, num_heads: int) -> None:
        """Which decode path each batch class runs, recorded (common/native/choice.py): the
        AVX-512 kernel as it is, the others timed against the torch path on these shapes."""
        dtype, native = kv_cache.dtype, self.native
        if self.native_march is None:
            return
        if native is None:
            no_cc = library_path(SOURCE, self.native_march) is None
            why = "no C compiler" if no_cc else "C kernel build or load failed"
            decode_choice.record_all(dtype, "torch", why)
            return
        q = kv_cache.new_empty(1, num_heads, kv_cache.shape[-1])
        if not native.supports(q, kv_cache):
            decode_choice.record_all(dtype, "torch", "head shape not taken by the C kernel")
        elif native.path == "c-avx512":
            decode_choice.record_all(dtype, native.path, "AVX-512 build, kept without timing")
        else:
            won = decode_choice.choose_native_classes(
                native.path, self._decode_c, self._decode_torch, kv_cache, num_heads
            )
            self.torch_classes = frozenset(decode_choice.BATCH_CLASSES) - won

    def _compile_fused(self, kv_caches: list[torch.Tensor], num_heads: int) -> None:
        """Compile the decode kernel over every layer's cache (dynamo guards on where a view
        starts, so the second layer generalizes the first graph): two queries over slots 0-4.
        NOTE: sizes unlike each other and the head counts, so that no two dimensions are
        compiled as "the same size"; it only reads the cache."""
        if self._attend_by_slot is None:
            return
        for kv_cache in kv_caches:
            heads, dim = kv_cache.shape[3:]
            flat = kv_cache.view(2, -1, heads, dim)
            q = kv_cache.new_zeros(2, heads, num_heads // heads, dim)
            slots = torch.arange(5, device=kv_cache.device).repeat(2, 1)
            lo, hi = slots.new_zeros(2), slots.new_full((2,), 5)
            self._attend_by_slot(q, flat[0], flat[1], slots, lo, hi, dim**-0.5)

    def _runs_native(self, query: torch.Tensor, kv_cache: torch.Tensor, nd: int) -> bool:
        """Once a layer: nothing to look up where one path serves every batch class."""
        native, torch_classes = self.native, self.torch_classes
        if native is None or len(torch_classes) == len(BATCH_CLASSES):
            return False
        if not native.supports(query, kv_cache):
            return False
        return not torch_classes or batch_class(nd) not in torch_classes

    def _decode_c(self, q, key, value, kv_cache, meta, scale, sliding_window) -> torch.Tensor:
        """The decodes' (B rows) attention by the C kernel, which writes their K/V rows."""
        new = (key, value, meta.slot_mapping[: q.shape[0]])
        return _decode_native(self.native, q, kv_cache, meta, scale, sliding_window, new)

    def _decode_torch(self, q, key, value, kv_cache, meta, scale, sliding_window) -> torch.Tensor:
        """The decodes' (B rows) attention by torch: their K/V rows written, then the compiled
        kernel where it pays, else SDPA on the gathered context."""
        nd = q.shape[0]
        write_kv(kv_cache, key, value, meta.slot_mapping[:nd])
        if self._attend_by_slot is not None and self._fused_pays(meta, nd):
            return _decode_fused(self._attend_by_slot, q, kv_cache, meta, scale, sliding_window)
        return _decode(q, kv_cache, meta, scale, sliding_window)

    def _fused_pays(self, meta: AttentionMetadata, nd: int) -> bool:
        return nd > 1 and nd * max(meta.seq_lens[:nd]) >= self.fused_min_tokens


PREFILL_KERNEL = "prefill_attention"

# below this many context tokens in a step's decodes (batch x longest), SDPA on the gathered
# context is as fast or faster: the compiled call's fixed cost (~40 us) dominates
# (benchmarks/kernels/bench_attention.py: the crossover is at 8 x 600 and 32 x 160 tokens)
FUSED_MIN_TOKENS = 4096


def _gather_one(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int):
    num_blocks = -(-seq_len // kv_cache.shape[2])
    kv = kv_cache[:, block_ids[:num_blocks]]  # (2, nb, bs, H, D)
    kv = kv.flatten(1, 2)[:, :seq_len]  # (2, L, H, D)
    return kv[0], kv[1]


def _prefill(q, k, v, scale, sliding_window):
    """q (Q, Hq, D) are the last Q of L positions; k/v (L, Hkv, D)."""
    num_q, seq_len = q.shape[0], k.shape[0]
    # NOTE: 4-D (1, H, *, D): on CPU a 3-D input takes SDPA's math path, a 4-D one its flash
    # kernel (4.6x faster at 1024 tokens, 1.2-1.4x at 128)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    if num_q == seq_len and sliding_window is None:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)


def _decode(q, kv_cache, meta: AttentionMetadata, scale, sliding_window):
    """q (B, Hq, D), one query per sequence, at position seq_len - 1."""
    nd = q.shape[0]
    slots, mask = _decode_plan(meta, nd, kv_cache.shape[2], sliding_window)
    heads, dim = kv_cache.shape[3:]
    flat = kv_cache.view(2, -1, heads, dim)
    k = flat[0].index_select(0, slots.view(-1)).view(nd, -1, heads, dim).transpose(1, 2)
    v = flat[1].index_select(0, slots.view(-1)).view(nd, -1, heads, dim).transpose(1, 2)
    # NOTE: each KV head's group of query heads is its "query sequence": (B, Hkv, G, D) over
    # (B, Hkv, L, D), no GQA expansion. In bf16 on CPU this is 6x faster than one query with
    # enable_gqa=True (2.6 ms vs 0.4 ms a layer at batch 32, 160 positions) and bit-identical
    out = F.scaled_dot_product_attention(
        q.view(nd, k.shape[1], -1, dim), k, v, attn_mask=mask, scale=scale
    )
    return out.view(nd, -1, dim)


def _decode_fused(attend, q, kv_cache, meta: AttentionMetadata, scale, sliding_window):
    """`_decode`'s result from one compiled kernel, `attend` (`_attend_by_slot` compiled):
    q (B, Hq, D) with B >= 2 (a batch of one would be a graph specialized to size 1)."""
    nd = q.shape[0]
    slots, lo, hi = _fused_plan(meta, nd, kv_cache.shape[2], sliding_window)
    heads, dim = kv_cache.shape[3:]
    flat = kv_cache.view(2, -1, heads, dim)
    out = attend(q.view(nd, heads, -1, dim), flat[0], flat[1], slots, lo, hi, scale)
    return out.view(nd, -1, dim)


def _decode_native(native: NativeDecode, q, kv_cache, meta: AttentionMetadata, scale, window, new):
    """`_decode`'s result from the C kernel: q (B, Hq, D); `new` (k, v, slots) the decodes' own
    K/V rows, written by the kernel."""
    nd = q.shape[0]
    key = ("native", window)
    if key not in meta.memo:  # once a step, shared by all layers
        hi = meta.seq_lens_tensor[:nd]
        lo = hi.new_zeros(nd) if window is None else (hi - window).clamp(min=0)
        meta.memo[key] = (meta.block_table[:nd], lo, hi, max(meta.seq_lens[:nd]))
    table, lo, hi, max_len = meta.memo[key]
    heads, dim = kv_cache.shape[3:]
    flat = kv_cache.view(2, -1, heads, dim)
    block_size = kv_cache.shape[2]
    k, v, slots = (t.contiguous() for t in new)
    return native(
        q.contiguous(), flat[0], flat[1], table, lo, hi, block_size, max_len, scale, (k, v, slots)
    )


def _compiled(fn):
    """`fn` under torch.compile, on a copy of its code: dynamo keeps graphs per code object,
    so each backend (one per engine) has its own, and engines of other models and dtypes in
    one process never add up to dynamo's recompile limit."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    return torch.compile(own, dynamic=True, fullgraph=True)


def _attend_by_slot(q, k_flat, v_flat, slots, lo, hi, scale: float):
    """q (B, Hkv, G, D): one query per sequence, each KV head's group of query heads; its
    context is k/v_flat (slots, Hkv, D) at `slots` (B, L), positions [lo, hi) valid. float32
    throughout; written as products and sums, not matmuls, so that inductor fuses the slot
    reads into the two reductions instead of gathering K/V first."""
    k = k_flat[slots].float()  # (B, L, Hkv, D)
    v = v_flat[slots].float()
    scores = (q.float()[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # (B, L, Hkv, G)
    pos = torch.arange(slots.shape[1], device=q.device)[None, :]
    valid = (pos >= lo[:, None]) & (pos < hi[:, None])
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * v[:, :, :, None, :]).sum(1)  # (B, Hkv, G, D)
    return out.to(q.dtype)


def _fused_plan(meta: AttentionMetadata, nd: int, block_size: int, sliding_window: int | None):
    """Slots (B, L) and the valid positions [lo, hi) of every decode's context; once a step."""
    key = ("fused", sliding_window)
    if key not in meta.memo:
        slots, _ = _decode_plan(meta, nd, block_size, None)
        hi = meta.seq_lens_tensor[:nd]
        lo = hi.new_zeros(nd) if sliding_window is None else (hi - sliding_window).clamp(min=0)
        meta.memo[key] = (slots, lo, hi)
    return meta.memo[key]


def _decode_plan(meta: AttentionMetadata, nd: int, block_size: int, sliding_window: int | None):
    """Flat cache slots (B, L) of every decode's context and its mask (B, 1, 1, L) or None;
    computed once per step and shared by all layers."""
    key = ("decode", sliding_window)
    if key not in meta.memo:
        lens = meta.seq_lens_tensor[:nd, None]
        max_len = max(meta.seq_lens[:nd])
        pos = torch.arange(max_len, device=lens.device)[None, :]  # (1, L)
        table = meta.block_table[:nd]
        slots = table.gather(1, (pos // block_size).expand(nd, -1)) * block_size + pos % block_size
        mask = pos < lens
        if sliding_window is not None:
            mask &= pos >= lens - sliding_window
        # NOTE: no host sync under a CUDA graph capture: the mask then always stays
        capturing = lens.is_cuda and torch.cuda.is_current_stream_capturing()
        mask = None if not capturing and bool(mask.all()) else mask[:, None, None]
        meta.memo[key] = (slots, mask)
    return meta.memo[key]
