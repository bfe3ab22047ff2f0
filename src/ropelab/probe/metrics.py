"""Perturbation metrics: pure functions of the captured analysis tensors.

Every function takes a stage's capture with the repeats on the first axis, x (R, ...), and
compares repeat r with repeat 0. Any further axes (heads, channels) are flattened into one
vector per repeat for the distances; the variance keeps the channel axis (the last).
Computed in float64 so that the tiny differences of a near-identical repeat are not rounded
away.
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).double()


def cosine_distance_to_first(x: torch.Tensor) -> torch.Tensor:
    """(R,) 1 - cos(x_r, x_0); 0 for a repeat pointing the same way as the first, up to 2.
    A zero vector has distance 1 from anything (cosine taken as 0)."""
    rows = _rows(x)
    norms = rows.norm(dim=1)
    dots = rows @ rows[0]
    denom = norms * norms[0]
    cos = torch.where(denom > 0, dots / denom.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(dots))
    return 1.0 - cos.clamp(-1.0, 1.0)  # rounding can put |cos| a hair above 1


def relative_l2_to_first(x: torch.Tensor) -> torch.Tensor:
    """(R,) ||x_r - x_0|| / ||x_0||; NaN when the first repeat is all zeros."""
    rows = _rows(x)
    ref = rows[0].norm()
    diff = (rows - rows[0]).norm(dim=1)
    return diff / ref if ref > 0 else torch.full_like(diff, float("nan"))


def channel_variance(x: torch.Tensor) -> torch.Tensor:
    """Variance across repeats of every element, shape x.shape[1:] (population variance: divides by R)."""
    return x.double().var(dim=0, correction=0)


def split_variance(variance: torch.Tensor, rotated: torch.Tensor) -> dict[str, float]:
    """Mean per-channel variance over the rotated and the unrotated channels.

    variance (..., D) with channels last (e.g. heads x channels); rotated (D,) bool. A group
    with no channels (NoPE: no rotated ones; full RoPE: no unrotated ones) gives None."""
    out = {}
    for name, mask in (("rotated", rotated), ("unrotated", ~rotated)):
        out[name] = float(variance[..., mask].mean()) if bool(mask.any()) else None
    return out


def kl_to_first(logits: torch.Tensor) -> torch.Tensor:
    """(R,) KL(p_r || p_0) in nats, p_r = softmax of repeat r's logits (R, V): how far each repeat's
    next-token distribution has moved from the first one's."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (logp.exp() * (logp - logp[0])).sum(dim=-1).clamp_min(0.0)


def deviation_from_first(x: torch.Tensor) -> torch.Tensor:
    """(channels, R) |x_r - x_0| per channel, relative to the RMS of x_0, for heatmaps; any axes
    between the repeats and the channels (heads) are averaged."""
    x = x.double()
    diff = (x - x[0]).abs()
    if diff.dim() > 2:
        diff = diff.flatten(1, -2).mean(dim=1)
    scale = x[0].pow(2).mean().sqrt()
    return (diff / scale if scale > 0 else diff).T
