"""Which query/key channels rotate, and at which frequency: the map from a head's channels to
RoPE's frequency pairs, for the layout a layer actually uses.

Whatever the style, the first ``rotary_dims`` channels of a head rotate and the rest pass
through (see `ropelab.rope`). Within the rotated channels, ``half`` pairs channel i with
i + rotary_dims/2 and ``interleaved`` pairs 2i with 2i+1; pair i turns at frequency
``inv_freq[i]`` (style decides those numbers). A weight row of W_q or W_k writes one channel of
one head, so the same map assigns output rows to frequency pairs.

A selected-pair plan (`ropelab.rope.pairs`) also moves pairs: each head's rotated channels hold
the source pairs its KV group keeps and its pass-through channels the dropped ones, in the order
`ropelab.rope.pairs.channel_order` gives. Where every channel carries a pair of the full-head spectrum
(a plan, or full RoPE) the *source pair* of each channel is known, so the rows of two such
models correspond pair by pair even where their channels differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ropelab.config import ModelConfig
from ropelab.position.registry import build_rotation
from ropelab.rope import inverse_frequencies
from ropelab.rope.pairs import channel_order, kept_pairs

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


def _tuples(x: list) -> tuple:
    return tuple(_tuples(v) if isinstance(v, list) else v for v in x)


def _turns(inv_freq: tuple) -> tuple:
    return tuple(_turns(f) if isinstance(f, tuple) else 2 * math.pi / f if f else math.inf for f in inv_freq)


@dataclass(frozen=True)
class LayerRope:
    """RoPE as one layer applies it: rotated channel count, pairing, each pair's frequency and,
    under a plan, which source pairs each KV head keeps."""

    head_dim: int
    rotary_dims: int
    layout: str
    theta: float
    # radians per token, one per rotated pair; one tuple per KV head under a plan whose heads keep
    # different pairs (`ropelab.rope.layer_frequencies`, scaling included)
    inv_freq: tuple
    kept: Optional[tuple[tuple[int, ...], ...]] = None  # a plan's kept source pairs per KV head, None without
    spectrum: tuple[float, ...] = ()  # a plan's full-head spectrum theta^(-2i/head_dim), unscaled

    @property
    def rotated_mask(self) -> torch.Tensor:
        """(head_dim,) bool: True for the channels that rotate; a pair at frequency 0 (FoPE's clipped
        pairs) turns at no position, so its channels do not."""
        pairs = channel_pairs(self.head_dim, self.rotary_dims, self.layout)
        frequencies = self.inv_freq[0] if self.inv_freq and isinstance(self.inv_freq[0], tuple) else self.inv_freq
        turning = torch.tensor([bool(f) for f in frequencies] + [False], dtype=torch.bool)
        return turning[pairs]  # UNROTATED (-1) reads the appended False

    @property
    def wavelengths(self) -> tuple:
        """Tokens per full turn of each pair: 2*pi / frequency (shaped as `inv_freq`)."""
        return _turns(self.inv_freq)

    @property
    def maps_source_pairs(self) -> bool:
        """Whether every channel carries a pair of the full-head spectrum (a plan, or full RoPE), so
        that `source_pair_channels` is defined."""
        return self.kept is not None or self.rotary_dims == self.head_dim

    def channel_sources(self, kv_head: int) -> torch.Tensor:
        """(head_dim,) long: the source pair each channel of a head of KV group `kv_head` carries; a
        channel rotates when it is below `rotary_dims`. Under a plan the kept pairs come first and the
        dropped ones fill the pass-through channels; otherwise pair i is rotated pair i and the
        pass-through channels are `UNROTATED`."""
        if self.kept is None:
            return channel_pairs(self.head_dim, self.rotary_dims, self.layout)
        order = channel_order(self.kept[kv_head], self.head_dim, self.layout)
        return channel_pairs(self.head_dim, self.head_dim, self.layout)[order]

    def source_pair_channels(self, kv_head: int) -> torch.Tensor:
        """(head_dim/2, 2) long: the two channels of each source pair in a head of KV group `kv_head`,
        in the order of the source's own pair (its first channel first), for `maps_source_pairs` layers."""
        return torch.argsort(self.channel_sources(kv_head), stable=True).view(-1, 2)

    def source_frequencies(self, kv_head: int) -> tuple[float, ...]:
        """Radians per token of every source pair in a head of KV group `kv_head`: a kept pair's as the
        layer turns it (scaling included), a dropped one's from the full-head spectrum (what a full-RoPE
        source turns it at; the layer does not turn it). For `maps_source_pairs` layers."""
        if self.kept is None:
            return self.inv_freq
        kept = self.kept[kv_head]
        rotated = self.inv_freq[kv_head] if self.inv_freq and isinstance(self.inv_freq[0], tuple) else self.inv_freq
        out = list(self.spectrum)
        for pair, freq in zip(kept, rotated):
            out[pair] = freq
        return tuple(out)


def layer_rope(config: ModelConfig, layer: int) -> LayerRope:
    """Layer `layer`'s RoPE: its frequencies as the layer's rotation module turns them (its registered
    type's, `ropelab.position`: scaling included, FoPE's clipped ones 0) and, under a plan, each KV
    head's kept pairs and the full-head spectrum."""
    rope, head_dim, kv_heads = config.rope_for_layer(layer), config.head_size, config.kv_heads
    inv_freq = _tuples(build_rotation(config, layer).inv_freq.tolist())
    kept = kept_pairs(rope, head_dim, kv_heads)
    if kept is None:
        return LayerRope(head_dim, rope.resolve_dims(head_dim), rope.layout, float(rope.theta), inv_freq)
    spectrum = tuple(inverse_frequencies(head_dim, head_dim, rope.theta, "slice", rope.angles).tolist())
    return LayerRope(head_dim, rope.resolve_dims(head_dim), rope.layout, float(rope.theta), inv_freq,
                     _tuples(kept), spectrum)
