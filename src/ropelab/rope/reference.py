"""The reference rotation, out of place: rotates a slice of the channels and concatenates the
pass-through channels back, so it reads and writes every channel whatever the fraction. The in-place
fast path (`ropelab.rope.inplace`) gives the same numbers up to float32 rounding.

``half`` pairs channel i with i + rotary_dims/2 (rotate_half, NeoX/Llama), ``interleaved`` pairs 2i
with 2i+1 (GPT-J/RoFormer).
"""

from __future__ import annotations

import torch


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
