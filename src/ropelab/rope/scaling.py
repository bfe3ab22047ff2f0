"""RoPE context extension: new frequencies for a layer's rotated pairs, and an attention factor.

`scale_frequencies(inv_freq, dim, theta, scaling, seq_len)` takes the float64 inverse frequencies of
exactly the pairs a layer rotates, (P,) or (K, P) for a plan whose KV heads keep different pairs, and
returns (scaled frequencies of the same shape, attention factor). Every method is written through
each pair's own frequency f (wavelength 2 pi / f), never through its index, so the same code serves

  * the ``slice`` spectrum theta^(-2i/rotary_dims), where it equals Hugging Face transformers'
    `modeling_rope_utils` (whose dim is head_dim * partial_rotary_factor, the rotated channels),
  * the ``truncate`` spectrum theta^(-2i/head_dim), i < rotary_dims/2, and
  * a selected-pair plan (any subset of the full-head spectrum theta^(-2i/head_dim)).

`dim` is the exponent denominator of the spectrum the pairs come from: rotary_dims for ``slice``,
head_dim for ``truncate`` and plans (`spectrum_dims`). A pair of frequency f then sits at the
fractional spectrum index u(f) = (dim/2) log_theta(1/f) (u = i for pair i), and scaling a subset of a
spectrum gives the same numbers as scaling the whole spectrum and keeping the subset. Per method:

  linear    f / factor. No dim.
  ntk       theta' = theta * factor^(dim/(dim-2)), i.e. f' = f^(ln theta' / ln theta): the change of
            base applied to each pair's own frequency. dim sets the exponent: the spectrum's slowest
            pair (i = dim/2 - 1) is slowed by exactly `factor`, its fastest (f = 1) kept.
  dynamic   ntk with factor * L / L0 - (factor - 1) in place of factor, L the current length
            (largest position + 1), L0 = original_max_position; the identity while L <= L0 (HF's
            `_compute_dynamic_ntk_parameters`, whose L0 is max_position_embeddings).
  yarn      the ramp r(f) = clamp((u(f) - low) / (high - low), 0, 1), low and high the spectrum
            indices at which a pair turns beta_fast and beta_slow times in L0 tokens (rounded down and
            up to whole pairs when `truncate`, clamped to [0, dim - 1] as HF does); f' = f (1 - r) +
            (f / factor) r. Without `truncate` dim cancels: the ramp is linear in log wavelength
            between L0 / beta_fast and L0 / beta_slow.
  llama3    through wavelengths only: above L0 / low_freq_factor f / factor, below
            L0 / high_freq_factor f, smoothed between by L0 / wavelength. No dim.
  longrope  f_i / short_factor[i] while L <= L0, f_i / long_factor[i] beyond: one factor per
            rotated pair, in the layer's pair order (pair i of every KV head for a plan). No dim.

The attention factor (YaRN: 0.1 ln(factor) + 1, or mscale / mscale_all_dim as in HF, or the given
`attention_factor`; LongRoPE: sqrt(1 + ln factor / ln L0) by default; 1 for the others) multiplies
cos and sin, as HF multiplies its cos/sin tables. So it reaches the rotated channels only, of queries
and keys both: q.k over the rotated channels is scaled by factor^2, the pass-through channels of a
partial-RoPE head not at all (under full RoPE that is every channel, HF's "attention temperature").

Two methods depend on the current length L (`length_dependent`): dynamic and longrope.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ropelab.config.rope import RopeScalingConfig


def spectrum_dims(rotary_dims: int, head_dim: int, style: str, has_plan: bool) -> int:
    """The exponent denominator of the spectrum a layer's rotated pairs come from (`dim` above)."""
    return head_dim if style == "truncate" or has_plan else rotary_dims


def length_dependent(scaling: Optional[RopeScalingConfig]) -> bool:
    """Whether the scaled frequencies change with the current sequence length (dynamic, longrope)."""
    return scaling is not None and scaling.method in ("dynamic", "longrope")


def attention_factor(scaling: Optional[RopeScalingConfig]) -> float:
    """The factor multiplying cos and sin of the rotated channels (1 for methods without one, and None)."""
    if scaling is None:
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.method == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.mscale and scaling.mscale_all_dim:
            return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
        return mscale(scaling.factor)
    if scaling.method == "longrope":
        factor = scaling.factor if scaling.factor is not None else 1.0
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position))
    return 1.0


def _change_base(inv_freq: torch.Tensor, theta: float, ratio: torch.Tensor) -> torch.Tensor:
    """Frequencies under base theta * ratio instead of theta: f^(ln(theta * ratio) / ln theta)."""
    return torch.exp(torch.log(inv_freq) * (1 + torch.log(ratio) / math.log(theta)))


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScalingConfig) -> torch.Tensor:
    def index_turning(turns: float) -> float:  # spectrum index of the pair turning `turns` times in L0
        return dim * math.log(s.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(s.beta_fast), index_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero division
    u = (dim / 2) * torch.log(1 / inv_freq) / math.log(theta)
    ramp = ((u - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - ramp) + inv_freq / s.factor * ramp


def _llama3(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def scale_frequencies(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScalingConfig,
    seq_len: Optional[Union[int, torch.Tensor]] = None,
) -> tuple[torch.Tensor, float]:
    """(scaled inverse frequencies, attention factor) of the rotated pairs `inv_freq` (float64, (P,) or
    (K, P)) under `scaling` (a `RopeScalingConfig`, validated). `dim`: see `spectrum_dims`; `seq_len`:
    the current length (largest position + 1) for dynamic and longrope, an int or a 0-d tensor (so
    that torch.compile traces it); None means the original context."""
    s = scaling
    inv_freq = inv_freq.to(torch.float64)
    if s.method == "linear":
        scaled = inv_freq / s.factor
    elif s.method == "ntk":
        scaled = _change_base(inv_freq, theta, torch.tensor(s.factor ** (dim / (dim - 2)), dtype=torch.float64))
    elif s.method == "dynamic":
        original = s.original_max_position
        length = torch.as_tensor(original if seq_len is None else seq_len, dtype=torch.float64)
        grown = s.factor * length.clamp(min=original) / original - (s.factor - 1)  # 1 up to the original length
        scaled = _change_base(inv_freq, theta, grown.to(inv_freq.device) ** (dim / (dim - 2)))
    elif s.method == "yarn":
        scaled = _yarn(inv_freq, dim, theta, s)
    elif s.method == "llama3":
        scaled = _llama3(inv_freq, s)
    elif s.method == "longrope":
        short = torch.tensor(s.short_factor, dtype=torch.float64, device=inv_freq.device)
        long = torch.tensor(s.long_factor, dtype=torch.float64, device=inv_freq.device)
        beyond = torch.as_tensor(0 if seq_len is None else seq_len, device=inv_freq.device) > s.original_max_position
        scaled = inv_freq / torch.where(beyond, long, short)
    else:
        raise ValueError(f"unknown RoPE scaling method {s.method!r}")
    return scaled, attention_factor(s)


__all__ = ["attention_factor", "length_dependent", "scale_frequencies", "spectrum_dims"]
