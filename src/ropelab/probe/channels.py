"""Which query/key channels rotate, and at which frequency: the map from a head's channels to
RoPE's frequency pairs, for the layout a layer actually uses.

Whatever the style, the first ``rotary_dims`` channels of a head rotate and the rest pass
through (see `ropelab.rope`). Within the rotated channels, ``half`` pairs channel i with
i + rotary_dims/2 and ``interleaved`` pairs 2i with 2i+1; pair i turns at frequency
``inv_freq[i]`` (style decides those numbers). A weight row of W_q or W_k writes one channel of
one head, so the same map assigns output rows to frequency pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ropelab.config import ModelConfig
from ropelab.rope import inverse_frequencies

UNROTATED = -1


def pair_channels(rotary_dims: int, layout: str) -> torch.Tensor:
    """(rotary_dims/2, 2) long: the two channels of each frequency pair."""
    pairs = torch.arange(rotary_dims // 2)
    if layout == "half":
        return torch.stack((pairs, pairs + rotary_dims // 2), dim=1)
    return torch.stack((2 * pairs, 2 * pairs + 1), dim=1)


def channel_pairs(head_dim: int, rotary_dims: int, layout: str) -> torch.Tensor:
    """(head_dim,) long: the frequency pair of each channel of a head, `UNROTATED` (-1) for the
    pass-through channels."""
    out = torch.full((head_dim,), UNROTATED, dtype=torch.long)
    for pair, channels in enumerate(pair_channels(rotary_dims, layout)):
        out[channels] = pair
    return out


@dataclass(frozen=True)
class LayerRope:
    """RoPE as one layer applies it: rotated channel count, pairing, and each pair's frequency."""

    head_dim: int
    rotary_dims: int
    layout: str
    theta: float
    inv_freq: tuple[float, ...]  # radians per token, one per pair

    @property
    def rotated_mask(self) -> torch.Tensor:
        """(head_dim,) bool: True for the channels that rotate."""
        return channel_pairs(self.head_dim, self.rotary_dims, self.layout) != UNROTATED

    @property
    def wavelengths(self) -> tuple[float, ...]:
        """Tokens per full turn of each pair: 2*pi / frequency."""
        return tuple(2 * math.pi / f for f in self.inv_freq)


def layer_rope(config: ModelConfig, layer: int) -> LayerRope:
    rope = config.rope_for_layer(layer)
    rotary_dims = rope.resolve_dims(config.head_size)
    inv_freq = inverse_frequencies(rotary_dims, config.head_size, rope.theta, rope.style)
    return LayerRope(config.head_size, rotary_dims, rope.layout, float(rope.theta), tuple(inv_freq.tolist()))
