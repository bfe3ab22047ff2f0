"""Rotary position embedding: the one place where RoPE math lives.

Conventions (see `RopeConfig` for the user-facing description):
  * only the first ``rotary_dims`` channels of each query/key head rotate; the rest pass
    through untouched (bit-identical);
  * ``rotary_dims = 2 * floor(fraction * head_dim / 2)``, at least 2 for fraction > 0;
  * ``slice`` frequencies ``theta^(-2i/rotary_dims)``, ``truncate`` ``theta^(-2i/head_dim)``,
    for i in [0, rotary_dims/2);
  * ``half`` pairs channel i with i + rotary_dims/2, ``interleaved`` pairs 2i with 2i+1;
  * angles are formed in float64 (exact for positions far beyond 2^24) and cos/sin are
    stored in float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ropelab.config import RopeConfig


def resolve_rotary_dims(head_dim: int, fraction: float = 1.0, rotary_dims: Optional[int] = None) -> int:
    """Number of rotated channels per head for a fraction or an explicit even count."""
    if rotary_dims is not None:
        return int(rotary_dims)
    if fraction <= 0:
        return 0
    return max(2, 2 * math.floor(fraction * head_dim / 2 + 1e-9))


def effective_fraction(head_dim: int, rotary_dims: int) -> float:
    return rotary_dims / head_dim


def inverse_frequencies(
    rotary_dims: int, head_dim: int, theta: float, style: str = "slice"
) -> torch.Tensor:
    """Angular frequency of each rotated pair, shape (rotary_dims/2,), float64."""
    denominator = rotary_dims if style == "slice" else head_dim
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64) / denominator
    return 1.0 / (float(theta) ** exponents)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, shape positions.shape + (rotary_dims/2,), float32.

    The product is formed and reduced modulo 2*pi in float64, so positions up to about 2^32
    keep their angle exact to float32 precision (float32 angles lose it beyond 2^24 tokens)."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    angles = torch.remainder(angles, 2 * math.pi)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate every pair of `x` (..., T, rotary_dims) by angles given as cos/sin (..., T, rotary_dims/2).

    Computed in float32 and returned in x's dtype."""
    dtype = x.dtype
    x = x.float()
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(dtype)


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str = "half"
) -> torch.Tensor:
    """Rotate the first `rotary_dims` channels of x (B, H, T, D); the others are returned as they are."""
    if rotary_dims == 0:
        return x
    if rotary_dims == x.shape[-1]:
        return rotate(x, cos, sin, layout)
    return torch.cat((rotate(x[..., :rotary_dims], cos, sin, layout), x[..., rotary_dims:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE for one layer setting: frequencies, an optional cos/sin table, and the rotation.

    Layers whose settings are equal share one instance (see `Transformer`)."""

    def __init__(self, config: RopeConfig, head_dim: int):
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.rotary_dims = config.resolve_dims(head_dim)
        self.layout = config.layout
        # Plain attributes, not buffers: `model.to(torch.bfloat16)` must not cast them.
        self.inv_freq = inverse_frequencies(self.rotary_dims, head_dim, config.theta, config.style)
        self.cos_table: Optional[torch.Tensor] = None
        self.sin_table: Optional[torch.Tensor] = None

    @property
    def theta(self) -> float:
        return self.config.theta

    def set_theta(self, theta: float) -> None:
        """Switch RoPE base (e.g. between training phases); drops any cached table."""
        if not theta > 0:
            raise ValueError(f"rope theta must be > 0, got {theta}")
        self.config.theta = float(theta)
        self.inv_freq = inverse_frequencies(self.rotary_dims, self.head_dim, theta, self.config.style)
        self.cos_table = self.sin_table = None

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for position ids (B, T) -> each (B, 1, T, rotary_dims/2), float32."""
        if self.config.cache == "none":
            cos, sin = rope_angles(position_ids, self.inv_freq)
        else:
            needed = int(position_ids.max()) + 1
            if self.cos_table is None or self.cos_table.shape[0] < needed or self.cos_table.device != position_ids.device:
                size = max(needed, 0 if self.cos_table is None else self.cos_table.shape[0])
                positions = torch.arange(size, device=position_ids.device)
                self.cos_table, self.sin_table = rope_angles(positions, self.inv_freq)
            cos, sin = self.cos_table[position_ids], self.sin_table[position_ids]
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, Hq, T, D), k (B, Hk, T, D), position_ids (B, T) -> rotated q, k."""
        if self.rotary_dims == 0:
            return q, k
        cos, sin = self.cos_sin(position_ids)
        return (
            apply_partial_rope(q, cos, sin, self.rotary_dims, self.layout),
            apply_partial_rope(k, cos, sin, self.rotary_dims, self.layout),
        )

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cos_table, self.sin_table) if t is not None)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"rotary_dims={self.rotary_dims}/{self.head_dim} (fraction {self.rotary_dims / self.head_dim:.3f}), "
            f"theta={c.theta:g}, style={c.style}, layout={c.layout}, cache={c.cache}"
        )


def table_cache_bytes(seq_len: int, rotary_dims: int, dtype_bytes: int = 4) -> int:
    """Bytes of a cos+sin table for `seq_len` positions: 2 tables x seq_len x rotary_dims/2."""
    return 2 * seq_len * (rotary_dims // 2) * dtype_bytes

