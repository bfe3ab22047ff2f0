"""FoPE, Fourier position embedding (Hua et al. 2024, arXiv 2412.17739), as a RoPE whose rotation is
changed in two ways (`ropelab.config.position.FopeSpec`):

  * clipping: a frequency that turns less than once in the trained length (w < 2 pi / trained_length)
    is set to 0, so its channels pass through unrotated at every position, inside the trained length
    and beyond it alike;
  * a Fourier series per dimension: the cos and sin of pair i are sums over all the layer's (clipped)
    frequencies, cos'_i(p) = sum_j cos(p w_j) C[j, i], sin'_i(p) = sum_j sin(p w_j) S[j, i], with C
    and S (r/2, r/2) learned, initialised to the identity plus N(0, coefficient_std^2) noise.

The coefficients are parameters of each layer's own module (never shared), so the rotation always
takes the out-of-place reference path: autograd sees cos/sin and the coefficients get gradients (the
in-place rotation and the C and Triton kernels rebuild plain cos/sin from the frequencies).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ropelab.config.position import FopeSpec
from ropelab.config.rope import RopeConfig
from ropelab.rope.embedding import RotaryEmbedding


class FourierEmbedding(RotaryEmbedding):
    position_type = "fope"

    def __init__(self, config: RopeConfig, spec: FopeSpec, head_dim: int, kv_heads: int = 1):
        super().__init__(config, head_dim, kv_heads)
        self.spec = spec  # its type declares no fast_kernels: only the reference rotation runs (`fast_paths`)
        self.inv_freq = self.clipped(self.inv_freq)
        half = self.rotary_dims // 2
        self.cos_coefficients = nn.Parameter(torch.eye(half) + torch.randn(half, half) * spec.coefficient_std)
        self.sin_coefficients = nn.Parameter(torch.eye(half) + torch.randn(half, half) * spec.coefficient_std)

    def clipped(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Frequencies turning less than once in `trained_length` tokens set to 0."""
        floor = 2 * math.pi / self.spec.trained_length
        return torch.where(inv_freq < floor, torch.zeros_like(inv_freq), inv_freq)

    @property
    def rotating_pairs(self) -> int:
        """Pairs whose frequency is not clipped to 0 (per KV head: the first head's)."""
        frequencies = self.inv_freq if self.inv_freq.dim() == 1 else self.inv_freq[0]
        return int((frequencies > 0).sum())

    def _refresh(self, seq_len: Optional[int] = None) -> None:
        super()._refresh(seq_len)
        self.inv_freq = self.clipped(self.inv_freq)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos/sin of the clipped frequencies, mixed over frequencies by the coefficients."""
        cos, sin = super().cos_sin(position_ids)
        return cos @ self.cos_coefficients.float(), sin @ self.sin_coefficients.float()

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", fope: trained_length={self.spec.trained_length}, "
                f"{self.rotating_pairs}/{self.rotary_dims // 2} pairs rotate")
