"""Token sampler: one next token per running sequence from the model's last-position logits.

Contract (vLLM semantics):
- input: raw logits `(B, V)`, one row per sequence, and the sequences (`SamplingSeq`);
- output: one `SampledToken` per sequence, in order; the input logits are never modified;
- logprobs, when requested, come from the RAW logits (log_softmax before any penalty/temperature);
- order of logit processing: repetition penalty (prompt + output tokens), frequency/presence
  penalties (output tokens), min_tokens masking of eos/stop ids, then either argmax (greedy) or
  temperature -> top_k -> top_p -> min_p -> sample;
- a seeded sequence draws only from its own `generator` (one uniform per sampled step), so it
  yields the same tokens alone or in any batch; unseeded ones share the global RNG.

Speed: all-greedy batches without penalties/logprobs take one argmax. Otherwise the sampler
writes into (B, V) buffers it keeps across steps (fresh large tensors cost page faults on CPU);
penalties touch only the seen tokens; top_k, top_p and min_p reduce to one cutoff per row (each
keeps a prefix of the sorted vocabulary), found from the few largest values (a full sort only for
rows whose nucleus is wider); sampling is an inverse-CDF lookup (a cumsum and a binary search per
row). On CPU, argmax / sort / partition go through numpy (several times faster than torch's).
A `Sampler` is not thread-safe (its buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from common.engine.sampling_params import SamplingParams

# widths of the largest-values prefix tried, in order, before sorting a whole row
_CANDIDATE_WIDTHS = (512, 8192)
# below this a temperature is as good as greedy; dividing by less could overflow float32
_MIN_TEMPERATURE = 1e-5


class SamplingSeq(Protocol):
    """What the sampler reads of one running sequence."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step
    generator: torch.Generator | None  # CPU generator seeded from params.seed, else None


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw log-prob of token_id, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None = None  # top params.logprobs, descending


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos_token_ids = list(eos_token_ids)
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> list[SampledToken]:
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (
            f"logits {tuple(logits.shape)} must be (B, V) with B = {len(seqs)} seqs"
        )
        if all(_is_plain_greedy(seq) for seq in seqs):
            return [SampledToken(t) for t in _argmax(logits).tolist()]
        work = self._processed_logits(logits.float(), seqs)  # (B, V) float32
        token_ids = self._choose_tokens(work, seqs)  # (B,)
        return _with_logprobs(logits, token_ids, seqs)

    def banned_token_ids(self, seq: SamplingSeq) -> list[int]:
        """Ids masked by min_tokens: stop ids, and eos unless ignore_eos, until min_tokens out."""
        params = seq.sampling_params
        if len(seq.output_token_ids) >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else self.eos_token_ids
        return sorted(set(params.stop_token_ids).union(eos))

    def _processed_logits(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> torch.Tensor:
        """Penalised and min_tokens-masked logits: a copy if any row changes, else `logits`."""
        banned = [self.banned_token_ids(seq) for seq in seqs]
        if not any(banned) and not any(seq.sampling_params.has_penalties for seq in seqs):
            return logits
        work = self._buffer("work", logits).copy_(logits)
        apply_penalties(work, seqs)
        for i, ids in enumerate(banned):
            if ids:
                work[i, ids] = -torch.inf
        return work

    def _choose_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> torch.Tensor:
        tokens = torch.empty(len(seqs), dtype=torch.long)  # (B,)
        greedy = [i for i, seq in enumerate(seqs) if seq.sampling_params.is_greedy]
        sampled = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if greedy:
            tokens[greedy] = _argmax(_rows(logits, greedy)).cpu()
        if sampled:
            picked = _rows(logits, sampled)
            buffers = self._buffer("weights", picked), self._buffer("scratch", picked)
            tokens[sampled] = sample(picked, [seqs[i] for i in sampled], *buffers).cpu()
        return tokens

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A float32 scratch tensor shaped like `like`, reusing memory across steps."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < like.numel() or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(like.numel(), device=like.device)
        return buf[: like.numel()].view(like.shape)


def _is_plain_greedy(seq: SamplingSeq) -> bool:
    params = seq.sampling_params
    return (
        params.is_greedy
        and not params.has_penalties
        and params.logprobs is None
        and len(seq.output_token_ids) >= params.min_tokens
    )


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # NOTE: numpy's argmax is ~7x faster than torch's on CPU for (32, 49152) float32.
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return x if len(rows) == x.shape[0] else x[rows]


# --- penalties -------------------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SamplingSeq]) -> None:
    """Penalise row i of logits (B, V) in place by seqs[i]'s params; touches only seen tokens.

    Repetition (HF): logits of tokens in the prompt or output > 0 are divided by it, others
    multiplied. Frequency / presence (OpenAI): minus frequency * count + presence, output only.
    """
    assert logits.is_contiguous(), "penalties index the flattened logits"
    params = [seq.sampling_params for seq in seqs]
    flat, vocab_size = logits.view(-1), logits.shape[1]  # (B * V,)
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rows:
        seen = [seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rows]
        keys, _ = _unique_keys(seen, rows, logits)  # (N,) = row * V + token
        factor = _per_row([p.repetition_penalty for p in params], keys // vocab_size)
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / factor, values * factor)
    rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if rows:
        keys, counts = _unique_keys([seqs[i].output_token_ids for i in rows], rows, logits)
        row_of_key = keys // vocab_size
        frequency = _per_row([p.frequency_penalty for p in params], row_of_key)
        presence = _per_row([p.presence_penalty for p in params], row_of_key)
        flat[keys] -= frequency * counts + presence


def _unique_keys(
    id_lists: list[list[int]], rows: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys `row * V + id` (N,) of rows[j]'s id_lists[j], and counts (N,), on logits'."""
    lengths = torch.tensor([len(ids) for ids in id_lists])
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    ids = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    keys, counts = torch.unique(row_ids * logits.shape[1] + ids, return_counts=True)
    return keys.to(logits.device), counts.to(logits.device)


def _per_row(values: list[float], row_of_key: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=row_of_key.device)[row_of_key]  # (N,)


# --- sampling --------------------------------------------------------------------------------


def sample(
    logits: torch.Tensor,
    seqs: Sequence[SamplingSeq],
    weights: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled token ids (S,) from processed float32 logits (S, V), which are left unchanged.

    weights, scratch: optional float32 tensors shaped like logits, written instead of allocating.
    """
    params = [seq.sampling_params for seq in seqs]
    scratch = torch.empty_like(logits) if scratch is None else scratch
    inv_temperature = _column([1 / max(p.temperature, _MIN_TEMPERATURE) for p in params], logits)
    # unnormalised probabilities exp((logit - max) / T) in [0, 1], exactly 1 for the top token
    weights = torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=weights)  # (S, V)
    weights.mul_(inv_temperature).exp_()
    cutoff = filter_cutoffs(weights, params)  # (S, 1) or None
    if cutoff is not None:
        # NOTE: a float 0/1 mask: torch's CPU masked_fill / where on bool masks are ~5x slower
        weights.mul_(torch.ge(weights, cutoff, out=scratch))
    return inverse_cdf(weights, _uniforms(seqs).to(weights.device), out=scratch)


def filter_cutoffs(weights: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Per-row weight cutoff (S, 1) below which top_k, top_p or min_p drop a token; None: no filter.

    weights (S, V): unnormalised probabilities whose row max is 1. min_p keeps p >= min_p * p_max,
    whatever top_k/top_p kept (renormalising does not change probability ratios).
    """
    rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
    if not rows and all(p.min_p == 0 for p in params):
        return None
    cutoff = _column([p.min_p for p in params], weights)
    if rows:
        vocab_size, device = weights.shape[1], weights.device
        picked = [params[i] for i in rows]
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in picked]
        top_p = [p.top_p if p.top_p < 1 else 2.0 for p in picked]  # > 1: off
        k_p_cut = top_k_top_p_cutoff(
            _rows(weights, rows),
            torch.tensor(top_k, device=device),
            torch.tensor(top_p, device=device),
        )
        cutoff[rows] = torch.maximum(cutoff[rows], k_p_cut[:, None])
    return cutoff


def top_k_top_p_cutoff(
    weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Lowest kept weight (R,) after top_k (R,) (V: off) then top_p (R,) (> 1: off) on (R, V) >= 0.

    Looks at the few largest weights first; rows whose nucleus is wider retry on a full sort.
    """
    vocab_size = weights.shape[1]
    # mass of the whole row (R,), only read where top_k is off
    total = weights.sum(dim=-1) if bool((top_k == vocab_size).any()) else torch.zeros_like(top_p)
    cutoff = torch.empty(weights.shape[0], device=weights.device)
    pending = torch.arange(weights.shape[0], device=weights.device)
    pending_weights = weights
    max_k = int(top_k.masked_fill(top_k == vocab_size, 0).max())  # largest active top_k
    for width in sorted({min(max(w, max_k), vocab_size) for w in (*_CANDIDATE_WIDTHS, vocab_size)}):
        top = _largest(pending_weights, width)  # (P, width) descending
        cut, fits = _cutoff_within(top, top_k[pending], top_p[pending], total[pending])
        cutoff[pending[fits]] = cut[fits]
        pending = pending[~fits]
        if pending.numel() == 0:
            break
        pending_weights = weights[pending]
    return cutoff


def _largest(x: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` largest values of each row of x (R, V), descending: (R, width)."""
    if x.device.type != "cpu":
        return x.topk(width, dim=-1).values
    # NOTE: numpy's SIMD sort / partition are ~10x faster than torch.sort / topk on CPU.
    values, vocab_size = x.numpy(), x.shape[1]
    if width < vocab_size:
        top = np.sort(np.partition(values, vocab_size - width, axis=-1)[:, -width:], axis=-1)
        return torch.from_numpy(top[:, ::-1].copy())
    top = np.sort(-values, axis=-1)  # descending without a (slow) reversed copy of a whole row
    return torch.from_numpy(np.negative(top, out=top))


def _cutoff_within(
    top: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cutoff (P,) from a row's `width` largest weights (P, width), and whether it is exact (P,).

    Exact when the row's top_k fits in `width` (always at width V: off is V) or its nucleus does.
    Keeps the smallest prefix whose mass reaches top_p of the top_k mass, at most top_k tokens.
    """
    width = top.shape[1]
    mass = top.cumsum(dim=-1)  # (P, width), nondecreasing
    k_fits = top_k <= width
    k_mass = mass.gather(1, (top_k.clamp(max=width) - 1)[:, None]).squeeze(1)
    target = top_p * torch.where(k_fits, k_mass, total)  # (P,)
    # prefixes [0, j) with mass < target are short: keep one more token than there are of them
    num_kept = torch.searchsorted(mass, target[:, None]).squeeze(1) + 1
    num_kept = torch.minimum(num_kept.clamp_(max=width), top_k)
    fits = k_fits | (mass[:, -1] >= target)
    return top.gather(1, (num_kept - 1)[:, None]).squeeze(1), fits


def inverse_cdf(
    weights: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Index (S,) drawn with probability proportional to weights (S, V) >= 0, one u (S,) per row.

    The first index whose cumulative weight exceeds u * total; zero-weight tokens never win.
    out: optional (S, V) float32 scratch for the cumulative weights.
    """
    cdf = torch.cumsum(weights, dim=-1, out=out)  # (S, V)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # keep the target < total
    target = torch.minimum(uniforms[:, None] * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _uniforms(seqs: Sequence[SamplingSeq]) -> torch.Tensor:
    """One U[0, 1) per row (S,): from the seq's own generator if seeded, else the global RNG."""
    uniforms = torch.empty(len(seqs))
    unseeded = [i for i, seq in enumerate(seqs) if seq.generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded))
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            uniforms[i : i + 1] = torch.rand(1, generator=seq.generator)
    return uniforms


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # (S, 1)


# --- logprobs --------------------------------------------------------------------------------


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, seqs: Sequence[SamplingSeq]
) -> list[SampledToken]:
    out = [SampledToken(t) for t in token_ids.tolist()]
    rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None]
    if not rows:
        return out
    logprobs = _rows(raw, rows).float().log_softmax(dim=-1)  # (R, V)
    chosen = logprobs.gather(1, token_ids[rows].to(raw.device)[:, None]).squeeze(1).tolist()
    num_top = [seqs[i].sampling_params.logprobs for i in rows]
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)  # (R, max N)
    for j, i in enumerate(rows):
        n = num_top[j]
        out[i].logprob = chosen[j]
        pairs = zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True)
        out[i].top_logprobs = list(pairs)
    return out


def skip_draw(seq: SamplingSeq) -> None:
    """Consume the random draw a sampling step of `seq` makes, for a token sampled elsewhere (a
    prefill worker's first token), so the seeded sequence continues as if sampled here."""
    if seq.generator is not None and not seq.sampling_params.is_greedy:
        torch.rand(1, generator=seq.generator)
