"""Small helpers that several test modules share."""

from __future__ import annotations

import torch


def randomize_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial values everywhere, from a fixed generator: norms around 1, weights around 0."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    return model.eval()


def fit_lengths(lengths: list[int], T: int) -> list[int]:
    """Document lengths trimmed or extended so that they sum to T."""
    out, total = [], 0
    for n in lengths:
        n = min(n, T - total)
        if n:
            out.append(n)
            total += n
    if total < T:
        out.append(T - total)
    return out
