"""RoPE frequencies and angles: the spectrum of a layer's rotated pairs and the cos/sin of position x frequency.

  * ``slice`` frequencies ``theta^(-2i/rotary_dims)``, ``truncate`` ``theta^(-2i/head_dim)``, for i in
    [0, rotary_dims/2); a selected-pair plan keeps its pairs' full-head frequencies (`ropelab.rope.pairs`),
    and context extension scales them (`ropelab.rope.scaling`);
  * angles are formed in float64 (exact for positions far beyond 2^24) and cos/sin are returned in
    float32 whatever the model dtype.
"""

from __future__ import annotations

import math

import torch

from ropelab.config.rope import RopeConfig
from ropelab.rope.pairs import kept_pairs
from ropelab.rope.scaling import scale_frequencies, spectrum_dims


def inverse_frequencies(
    rotary_dims: int, head_dim: int, theta: float, style: str = "slice", precision: str = "float64"
) -> torch.Tensor:
    """Angular frequency of each rotated pair, shape (rotary_dims/2,), float64. With `precision`
    float32 they are computed in float32 as HF transformers does (and held as float64 of those values)."""
    denominator = rotary_dims if style == "slice" else head_dim
    dtype = torch.float32 if precision == "float32" else torch.float64
    exponents = torch.arange(0, rotary_dims, 2, dtype=dtype) / denominator
    return (1.0 / (float(theta) ** exponents)).to(torch.float64)


def layer_frequencies(config: RopeConfig, head_dim: int, kv_heads: int = 1, seq_len=None) -> torch.Tensor:
    """Inverse frequencies of a layer's rotated pairs, float64: (rotary_dims/2,) when every head turns
    alike, (kv_heads, r) when a selected-pair plan keeps other pairs in each KV head. A plan's pairs keep
    their full-head frequencies ``theta^(-2i/head_dim)``. With `config.scaling` they are then scaled by
    its method (`ropelab.rope.scaling`), dynamic NTK and LongRoPE at length `seq_len` (an int or a 0-d
    tensor; None: the original context)."""
    plan = kept_pairs(config, head_dim, kv_heads)
    if plan is None:
        inv_freq = inverse_frequencies(config.resolve_dims(head_dim), head_dim, config.theta, config.style,
                                       config.angles)
    else:
        spectrum = inverse_frequencies(head_dim, head_dim, config.theta, "slice", config.angles)
        same = all(heads == plan[0] for heads in plan)
        inv_freq = spectrum[torch.tensor(plan[0] if same else plan, dtype=torch.long)]  # (r,) or (K, r)
    if config.scaling is None:
        return inv_freq
    dim = spectrum_dims(config.resolve_dims(head_dim), head_dim, config.style, config.has_plan)
    return scale_frequencies(inv_freq, dim, config.theta, config.scaling, seq_len)[0]


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, precision: str = "float64"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, shape positions.shape + inv_freq.shape, float32.

    The product is formed and reduced modulo 2*pi in float64, so positions up to about 2^32
    keep their angle exact to float32 precision (float32 angles lose it beyond 2^24 tokens).
    `precision` float32 forms it in float32 instead, as HF transformers does (for parity with it)."""
    shape = positions.shape + inv_freq.shape
    if precision == "float32":
        angles = positions.to(torch.float32).reshape(-1, 1) * inv_freq.to(positions.device, torch.float32).reshape(1, -1)
        return angles.cos().reshape(shape), angles.sin().reshape(shape)
    angles = positions.to(torch.float64).reshape(-1, 1) * inv_freq.to(positions.device, torch.float64).reshape(1, -1)
    angles = torch.remainder(angles, 2 * math.pi)
    return angles.cos().to(torch.float32).reshape(shape), angles.sin().to(torch.float32).reshape(shape)


def table_cache_bytes(seq_len: int, rotary_dims: int, dtype_bytes: int = 4) -> int:
    """Bytes of a cos+sin table for `seq_len` positions: 2 tables x seq_len x rotary_dims/2."""
    return 2 * seq_len * (rotary_dims // 2) * dtype_bytes
