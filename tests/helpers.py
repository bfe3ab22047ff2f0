"""Small helpers that several test modules share."""

from __future__ import annotations

import math

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


# unit roundoff (half the spacing of numbers just above 1) of the formats the models compute in
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def parity_tolerance(magnitude: float, layers: int, reduction: int, dtype: torch.dtype = torch.float32,
                     angle_positions: int = 0) -> float:
    """The largest absolute difference between two correct implementations' logits that rounding explains:
    magnitude * sqrt(layers + 1) * (u32 * (sqrt(reduction) + angle_positions) + u), u the unit roundoff of
    `dtype` and u32 that of float32.

    Two implementations of the same model (ropelab and transformers; one kernel and another; AVX2 and
    AMX matrix products, which block their sums differently) add the same products in other orders.
    A sum of n terms, accumulated in float32 as matrix products and reductions are on every backend
    here, is then off by about u32 * sqrt(n) relative to its size (rounding errors as independent
    random steps: Higham and Mary, "A new approach to probabilistic rounding error analysis", 2019);
    `reduction` is the longest sum: d_model, d_ff, or the number of keys attention sums over. Each
    stored result adds u of its own format (u32 again in float32, 2^-8 in bf16). Each residual block
    adds its error to the residual stream, and the output head one more product, so over `layers`
    blocks independent errors grow as sqrt(layers + 1), and the logits, a linear read-out of that
    stream, carry the relative error times their own `magnitude` (the largest |logit|).
    `angle_positions`: where one side forms RoPE angles position * frequency in float32 and the other
    in float64 (ropelab's default), the float32 angle at position p is off by up to u32 * p radians
    (frequencies <= 1), a relative error of q and k of that size; give the largest position.

    Measured against it (fp32, Intel AMX): SmolLM2-135M over 1,024 tokens, 30 layers, |logits| <= 44.6,
    differs from transformers by 1.7e-4 where it allows 6.0e-4, while one weight changed by 1% (the
    largest of layer 0's W_k) moves the logits 1.4e-3, beyond it."""
    u32, u = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[dtype]
    return magnitude * math.sqrt(layers + 1) * (u32 * (math.sqrt(reduction) + angle_positions) + u)


def assert_logits_match(ours: torch.Tensor, reference: torch.Tensor, config, angles_differ: bool = False) -> None:
    """`ours` (..., T, V) within `parity_tolerance` of `reference`, for a model of ropelab ModelConfig
    `config` (its layers; its longest sum: d_model, d_ff, the query width or T keys) in reference's dtype.
    `angles_differ`: one side forms RoPE angles in float32, the other in float64, at positions up to T - 1."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    tokens = reference.shape[-2]
    reduction = max(config.d_model, config.d_ff, config.n_head * config.head_size, tokens)
    tolerance = parity_tolerance(reference.abs().max().item(), config.n_layer, reduction, reference.dtype,
                                 tokens - 1 if angles_differ else 0)
    diff = (ours.float() - reference.float()).abs().max().item()
    assert diff <= tolerance, f"logits differ by up to {diff:.3g}, beyond the {tolerance:.3g} rounding explains"
