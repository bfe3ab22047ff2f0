"""Small helpers that several test modules share."""

from __future__ import annotations

import math
from typing import Optional, Sequence

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
# the results a Llama block rounds to its dtype: two norms, q, k, v, rotated q and k, scores, weights,
# the attention output, its projection, gate, up, the activation, their product, down, two residual adds
BLOCK_STORES = 18


def parity_tolerance(magnitude: float, layers: int, sums: Sequence[int], stores: int,
                     dtype: torch.dtype = torch.float32, angle_positions: int = 0) -> float:
    """The largest absolute difference between two correct implementations' logits that rounding explains:
    magnitude * (sqrt(layers + 1) * (sqrt(u32^2 * sum(sums) + stores * u^2) + u32 * angle_positions) + 2u),
    u the unit roundoff of `dtype` and u32 that of float32.

    Two implementations of the same model (ropelab and transformers; one kernel and another; AVX2 and
    AMX matrix products, which block their sums differently) add the same products in other orders.
    A sum of n terms, accumulated in float32 as matrix products and reductions are on every backend
    here, is then off by about u32 * sqrt(n) relative to its size (rounding errors as independent
    random steps: Higham and Mary, "A new approach to probabilistic rounding error analysis", 2019),
    and each of the `stores` results a block rounds to its format adds u (u32 again in float32, 2^-8
    in bf16, where these dominate). `sums` are the lengths of the sums one block's output goes through
    in turn (`block_sums`): their independent errors add in quadrature (a sum whose error is amplified
    g times counts g^2 times its length).
    Each residual block adds its error to the residual stream, and the output head one more product,
    so over `layers` blocks they grow as sqrt(layers + 1), and the logits, a linear read-out of that
    stream, carry the relative error times their `magnitude` (the largest |logit|, which for logits
    spread like a Gaussian also carries the few-sigma factor of the largest of many errors); rounding
    the logits themselves to `dtype` on each side adds up to one unit in their last place, 2u of them.
    `angle_positions`: where one side forms RoPE angles position * frequency in float32 and the other
    in float64 (ropelab's default), the float32 angle at position p is off by up to u32 * p radians
    (frequencies <= 1), a relative error of q and k of that size; the largest p.

    Measured against it (fp32, Intel AMX): SmolLM2-135M over 1,024 tokens (30 layers, |logits| <= 44.6)
    differs from transformers by 1.7e-4 where it allows 1.1e-3; one weight 1% off (the largest of the
    last layer's W_k) moves its logits by 1.6e-2. Tiny two-layer models: up to half of it, in bf16 0.4."""
    u32, u = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[dtype]
    per_block = math.sqrt(u32**2 * sum(sums) + stores * u**2) + u32 * angle_positions
    return magnitude * (math.sqrt(layers + 1) * per_block + 2 * u)


def block_sums(config, keys: int, scores: float = 1.0) -> list[int]:
    """The lengths of the sums a block of ropelab ModelConfig `config` computes one after the other over
    `keys` attended tokens: the attention norm, the q/k/v projections, q.k, the weighted sum of values,
    the output projection, the MLP norm, its input projections and its output projection.

    Softmax turns an absolute error ds of a score into a relative error (1 - p) ds of its weight p,
    so the q.k sum's relative error reaches the weights times the score's size where the weight is not
    saturated: `scores`, the largest |score| (`largest_attention_score`), for random weights far from
    their init, which spread large scores over many keys. A trained model's largest scores sit on
    attention sinks whose weight is near 1, and count as 1 (SmolLM2-135M: largest score 82 on os.py,
    its difference from transformers 0.16 of the tolerance without the factor)."""
    d = config.d_model
    qk = round(config.head_size * max(1.0, scores) ** 2)
    return [d, d, qk, keys, config.n_head * config.head_size, d, d, config.d_ff]


def largest_attention_score(model, idx: torch.Tensor) -> float:
    """The largest |q.k| / sqrt(head_size) of ropelab Transformer `model`'s attention over tokens `idx`."""
    largest = []

    def measure(attention, args):
        x, positions, *_, norm = args  # Attention(x, position_ids, doc_ids, kv_cache, norm)
        q, k, _ = attention.queries_keys_values(x, positions, norm)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        largest.append((q @ k.transpose(-1, -2)).tril().abs().max().item() / q.shape[-1] ** 0.5)

    hooks = [block.attn.register_forward_pre_hook(measure) for block in model.blocks]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return max(largest)


def assert_logits_match(ours: torch.Tensor, reference: torch.Tensor, config, angles_differ: bool = False,
                        keys: Optional[int] = None, scores: float = 1.0) -> None:
    """`ours` (..., T, V) within `parity_tolerance` of `reference` (its dtype and largest |logit|) for a
    model of ropelab ModelConfig `config` whose queries attend to up to `keys` tokens (default T), with
    attention scores up to `scores` (weights far from a trained model's: see `block_sums`).
    `angles_differ`: one side forms RoPE angles in float32, the other in float64, at positions < keys."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    keys = reference.shape[-2] if keys is None else keys
    tolerance = parity_tolerance(reference.abs().max().item(), config.n_layer, block_sums(config, keys, scores),
                                 BLOCK_STORES, reference.dtype, keys - 1 if angles_differ else 0)
    diff = (ours.float() - reference.float()).abs().max().item()
    assert diff <= tolerance, f"logits differ by up to {diff:.3g}, beyond the {tolerance:.3g} rounding explains"
