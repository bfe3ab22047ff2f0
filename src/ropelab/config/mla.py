"""Multi-head latent attention (`model.mla`): the keys' non-rotated channels and the values of each KV head
drawn from one low-rank latent that the key/value cache holds instead of them (DeepSeek-V2's MLA, reached
from a pretrained model by MHA2MLA: Ji et al. 2025, arXiv 2502.14837).

A layer rotating 2r of its head_dim D channels (its RoPE plan keeps r pairs per KV head, in the first 2r
channels) keeps those as a decoupled positional key, projected from x as before; the other D - 2r key
channels and the D value channels come from c = W_down x, `rank` (d) values per KV head. The rank at which
that is exact for any weights is the smaller of d_model and the stacked rows (D - 2r) + D: `full_rank`.
Torch-free, as every config module.
"""

from __future__ import annotations

from dataclasses import dataclass

from ropelab.errors import ConfigError


INITS = ("svd-joint", "svd-split")
# RoPE scalings whose frequencies follow the current length: the latent cache holds positional keys rotated
# at the length each was seen, so decoding over it would not give the forward over the whole sequence.
# The static ones (linear, ntk, yarn, llama3) only retune the kept pairs, YaRN's factor only their channels.
LENGTH_DEPENDENT = ("dynamic", "longrope")  # how `ropelab convert` draws the latent from the weights (`ropelab.mla.convert`)


def full_rank(d_model: int, head_dim: int, rotary_dims: int) -> int:
    """The latent rank at which [W_k,nope; W_v] of one KV head ((D - 2r) + D rows, d_model columns) is
    reproduced exactly: min(d_model, 2 * head_dim - rotary_dims)."""
    return min(d_model, 2 * head_dim - rotary_dims)


def cached_values(rank: int, rotary_dims: int) -> int:
    """Values one KV head caches per token: the latent and the rotated key channels, d + 2r."""
    return rank + rotary_dims


@dataclass
class MLAConfig:
    """`rank`: the latent's size per KV head (d)."""

    rank: int = 8

    def validate(self, model) -> None:
        """`model`: the `ModelConfig` holding this section (its layers' rotations and shapes)."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"model.mla.rank={self.rank!r}: must be an integer >= 1 (the latent's size per KV head)")
        if model.qk_norm:
            raise ConfigError("model.mla: not with model.qk_norm (the norm of each whole key head is not linear in a "
                              "latent shared with the values)")
        D = model.head_size
        for layer in range(model.n_layer):
            positions = model.positions_for_layer(layer)
            rotation = positions[0].type
            if (rotation.rope_keys and not rotation.fast_kernels) or len(positions) > 1:
                raise ConfigError(f"model.mla: layer {layer} is {rotation.label} with {len(positions) - 1} more "
                                  "position encoding(s); MLA keeps plain RoPE pairs as its positional key, alone")
            if model.layer_kind(layer).temperature is not None:
                raise ConfigError(f"model.mla: layer {layer} has a query temperature; MLA layers take none")
            rope = model.rope_for_layer(layer)
            if rope.scaling is not None and rope.scaling.method in LENGTH_DEPENDENT:
                raise ConfigError(f"model.mla: layer {layer}'s RoPE scaling {rope.scaling.method} follows the current "
                                  "length, but the latent cache keeps keys rotated at the length each was seen; "
                                  "use linear, ntk, yarn or llama3")
            dims = rope.resolve_dims(D)
            top = full_rank(model.d_model, D, dims)
            if self.rank > top:
                raise ConfigError(f"model.mla.rank={self.rank}: above full rank {top} for layer {layer} (min of "
                                  f"d_model {model.d_model} and (head_dim - 2r) + head_dim = {2 * D - dims})")


__all__ = ["INITS", "MLAConfig", "full_rank", "cached_values"]
