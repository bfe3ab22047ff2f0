"""A selected-pair model (each head's kept RoPE pairs in its first 2r channels, `ropelab.sources.plans`)
turned into multi-head latent attention (`ropelab.mla.attention`) by a low-rank factorisation of each KV
head's non-rotated key rows and value rows.

  svd-joint   MHA2MLA's joint SVD (Ji et al. 2025, arXiv 2502.14837, section 3.2): the stacked
              [W_k,nope; W_v] ((D - 2r) + D rows) of a KV head factorised at rank d: one latent serves both
  svd-split   W_k,nope and W_v factorised apart, the rank split between them in proportion to their rows;
              the latent is the two stacked, each up-projection reading its own part

Both are exact at full rank (`ropelab.config.mla.full_rank`) and keep the d largest singular values (the
best rank-d fit of the weights). The rotated key rows stay as they are: the decoupled positional key.
"""

from __future__ import annotations

import copy

import torch

from ropelab.config import ConfigError
from ropelab.config.mla import INITS, MLAConfig
from ropelab.model import Transformer

def _factor(rows: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (M, C) ~ up (M, rank) @ down (rank, C), the singular values split evenly between the two."""
    if rank == 0:
        return rows.new_zeros(rows.shape[0], 0), rows.new_zeros(0, rows.shape[1])
    # the SVD of the tall transpose: LAPACK's is several times faster than the wide matrix's (same factors)
    v, s, uh = torch.linalg.svd(rows.T, full_matrices=False)
    root = s[:rank].sqrt()
    return uh[:rank].T * root, root[:, None] * v[:, :rank].T


def split_ranks(rank: int, nope: int, head_dim: int, d_model: int) -> tuple[int, int]:
    """svd-split's ranks of the non-rotated keys and of the values: in proportion to their rows, each at
    most what its own matrix holds."""
    key_rank = min(round(rank * nope / (nope + head_dim)), nope, d_model)
    value_rank = min(rank - key_rank, head_dim, d_model)
    return rank - value_rank, value_rank


def head_latent(w_nope: torch.Tensor, w_v: torch.Tensor, rank: int, init: str) -> tuple[torch.Tensor, ...]:
    """One KV head: w_nope (N, C), w_v (D, C) -> W_uk (N, d), W_uv (D, d), W_down (d, C), in float64."""
    if init == "svd-joint":
        up, down = _factor(torch.cat([w_nope, w_v]), rank)
        return up[:w_nope.shape[0]], up[w_nope.shape[0]:], down
    key_rank, value_rank = split_ranks(rank, w_nope.shape[0], w_v.shape[0], w_v.shape[1])
    key_up, key_down = _factor(w_nope, key_rank)
    value_up, value_down = _factor(w_v, value_rank)
    k_up = torch.cat([key_up, key_up.new_zeros(key_up.shape[0], value_rank)], dim=1)
    v_up = torch.cat([value_up.new_zeros(value_up.shape[0], key_rank), value_up], dim=1)
    return k_up, v_up, torch.cat([key_down, value_down])


def latent_model(model: Transformer, rank: int, init: str = "svd-joint") -> Transformer:
    """A `model.mla` model of `rank` holding `model`'s weights, its keys' non-rotated channels and its values
    drawn from the latent by `init`. `model`: rotated channels first in every layer (full RoPE, a plan, NoPE)."""
    if init not in INITS:
        raise ConfigError(f"mla.init={init!r}: unknown; choose one of {', '.join(INITS)}")
    source = model.config
    if source.mla is not None:
        raise ConfigError(f"already an MLA model (model.mla.rank={source.mla.rank}); convert takes a model with "
                          "whole keys and values")
    config = copy.deepcopy(source)
    config.mla = MLAConfig(rank=rank)
    config.validate()
    H, K, D = source.n_head, source.kv_heads, source.head_size
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for layer, block in enumerate(model.blocks):
        R = block.attn.rope.rotary_dims
        prefix = f"blocks.{layer}.attn"
        w_k = state.pop(f"{prefix}.k_proj.weight").double().view(K, D, -1)
        w_v = state.pop(f"{prefix}.v_proj.weight").double().view(K, D, -1)
        parts = [head_latent(w_k[g, R:], w_v[g], rank, init) for g in range(K)]
        state[f"{prefix}.kr_proj.weight"] = w_k[:, :R].reshape(K * R, w_k.shape[-1])
        state[f"{prefix}.k_up.weight"] = torch.cat([p[0] for p in parts])
        state[f"{prefix}.v_up.weight"] = torch.cat([p[1] for p in parts])
        state[f"{prefix}.kv_down.weight"] = torch.cat([p[2] for p in parts])
        if f"{prefix}.k_proj.bias" in state:
            b_k = state.pop(f"{prefix}.k_proj.bias").view(K, D)
            state[f"{prefix}.kr_proj.bias"] = b_k[:, :R].reshape(-1)
            state[f"{prefix}.k_up.bias"] = b_k[:, R:].reshape(-1)
            state[f"{prefix}.v_up.bias"] = state.pop(f"{prefix}.v_proj.bias")
    dtype = next(model.parameters()).dtype
    converted = Transformer(config, init=False)
    converted.load_state_dict({name: tensor.to(dtype) for name, tensor in state.items()})
    return converted.to(dtype)


__all__ = ["latent_model", "head_latent", "split_ranks"]
