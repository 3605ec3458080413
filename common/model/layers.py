"""The math of a Llama-family decoder: RMSNorm and rotary embeddings (HF rotate-half)."""

from __future__ import annotations

import math

import torch
from torch import nn

from common.arch_config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), applied by position lookup."""

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None
    ):
        super().__init__()
        if torch.empty(()).is_meta:  # a layout pass: the loader builds the tables on a real
            # device (torch's meta kernels for this arithmetic import torch._dynamo: ~2 s)
            table = torch.empty(max_positions, head_dim)
            self.register_buffer("cos", table, persistent=False)
            self.register_buffer("sin", table.clone(), persistent=False)
            self._positions = None
            return
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._positions: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions (T,), q (T, Hq, D), k (T, Hkv, D) → rotated q, k."""
        if torch.compiler.is_compiling():  # the compiler fuses the lookup into the rotation
            cos, sin = self._lookup(positions, q.dtype)
        else:
            if positions is not self._positions:  # every layer of a step shares one lookup
                self._positions = positions
                self._cos, self._sin = self._lookup(positions, q.dtype)
            cos, sin = self._cos, self._sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin), each (T, 1, D)."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        return cos, self.sin[positions].unsqueeze(1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
