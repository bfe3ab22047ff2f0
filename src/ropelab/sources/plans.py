"""A selected-pair RoPE plan applied to a full-RoPE model's weights (MHA2MLA's partial RoPE).

  check_source(config, name)       the source rotates every channel of every layer (what a plan selects from)
  target_config(config, keep, select, explicit=None)
                                   the source's model config asking for a plan (2-norm still unscored)
  needs_scores(config)             whether some layer's plan is 2-norm and not chosen yet
  shape_config(config)             the config without such a plan (for parameter counts and FLOPs)
  resolve_plans(config, scores)    (per layer and KV head the kept pairs, the config with them written
                                   out: 2-norm layers get their scored `pairs`)
  apply_plan(model, config, plans) a new model whose W_q / W_k rows (biases, QK-Norm weights) are
                                   permuted so each head's kept pairs sit in its first 2r channels; its
                                   logits are the source's with the dropped pairs' rotation removed

Used by `ropelab convert` and by `train.init_from` a full-RoPE source into a run whose `model.rope`
holds a plan.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from ropelab.config import PLAN_KEYS, ConfigError, ModelConfig, RopeConfig
from ropelab.model import Transformer
from ropelab.rope.pairs import channel_order, head_rows, kept_pairs, top_pairs

# Per layer, per KV head: the kept pair indices, in the order they take the rotated channels.
Plans = list[list[list[int]]]


def check_source(config: ModelConfig, name: str) -> None:
    """A plan selects pairs of the full-head spectrum: every layer of the source must rotate all of its
    head's channels, without a plan of its own, and hold whole keys and values (no `model.mla` latent)."""
    if config.mla is not None:
        raise ConfigError(f"{name}: already an MLA model (model.mla.rank={config.mla.rank}); a RoPE plan and the "
                          "latent are made from a model with full RoPE and whole keys and values")
    for layer in range(config.n_layer):
        rotation = config.positions_for_layer(layer)[0].type
        if rotation.rope_keys and not rotation.fast_kernels:  # declared: not plain cos/sin of position x frequency
            raise ConfigError(f"{name}: layer {layer} is {rotation.label} ({rotation.summary}); a RoPE plan selects "
                              "pairs of plain RoPE, whose angles are position x frequency")
        rope = config.rope_for_layer(layer)
        dims = rope.resolve_dims(config.head_size)
        if rope.has_plan or dims != config.head_size:
            what = "has no RoPE" if dims == 0 else f"rotates {dims} of its {config.head_size} channels"
            raise ConfigError(f"{name}: layer {layer} {what}; a RoPE plan needs a source with full RoPE in every "
                              "layer (its pairs are what a plan selects)")


def _unscored(rope: RopeConfig) -> bool:
    return rope.select == "2-norm" and rope.pairs is None


def needs_scores(config: ModelConfig) -> bool:
    return any(_unscored(config.rope_for_layer(layer)) for layer in range(config.n_layer))


def shape_config(config: ModelConfig) -> ModelConfig:
    """`config` without a plan still to be scored: what parameter counts and FLOPs need (they do not
    depend on RoPE), for a run that converts at its start."""
    if not needs_scores(config):
        return config
    return dataclasses.replace(config, rope_layers={}, rope=dataclasses.replace(config.rope, **dict.fromkeys(PLAN_KEYS)))


def target_config(config: ModelConfig, keep: int, select: str, explicit: Optional[list] = None) -> ModelConfig:
    """`config` asking for a plan: keep 0 is NoPE (fraction 0); `explicit` (select ``list``) gives one entry
    per layer, a list of pairs or one list per KV head. Per-layer settings of the source (e.g. its own
    theta) stay."""
    new = copy.deepcopy(config)
    base = dataclasses.replace(new.rope, fraction=1.0, rotary_dims=None, style="slice")
    if explicit is not None:
        if len(explicit) != config.n_layer:
            raise ConfigError(f"rope.pairs: {len(explicit)} entries but the model has {config.n_layer} layers "
                              "(give one list of pairs, or one list per KV head, for every layer)")
        new.rope = base
        for layer, entry in enumerate(explicit):
            RopeConfig(pairs=entry).validate_plan(config.head_size, f"rope.pairs[{layer}]", config.kv_heads)
            _set_layer_pairs(new, layer, entry)
    elif keep == 0:
        new.rope = dataclasses.replace(base, fraction=0.0)
    else:
        new.rope = dataclasses.replace(base, keep_pairs=keep, select=select)
    new.validate()
    return new


def _set_layer_pairs(config: ModelConfig, layer: int, pairs: list) -> None:
    """The pairs chosen for `layer`, where its RoPE keys are spelled: its own position list's rotation entry
    (`model.position_layers`), else its `model.rope_layers` entry."""
    entries = config.layer_entry("position_layers", layer)
    if entries is not None:
        rotation = config.positions_for_layer(layer)[0].type.name
        next(entry for entry in entries if entry["type"] == rotation)["pairs"] = pairs
        return
    own = config.rope_layers.pop(layer, None) or config.rope_layers.pop(str(layer), None) or {}
    config.rope_layers[layer] = {**own, "pairs": pairs}


def resolve_plans(config: ModelConfig, scores: Optional[list[torch.Tensor]] = None) -> tuple[Plans, ModelConfig]:
    """Per layer and KV head, the pairs each layer keeps (all of them for a full-RoPE layer, none for NoPE),
    and `config` with every 2-norm layer's choice written out as its `pairs`. `scores` (per layer (K,
    n_pairs), `ropelab.sources.calibrate.two_norm_scores`) are summed over KV heads when the model has
    QK-Norm: its norm weight is shared by every head, so every head of a layer keeps the same pairs."""
    D, K = config.head_size, config.kv_heads
    resolved = copy.deepcopy(config)
    plans: Plans = []
    for layer in range(config.n_layer):
        rope = config.rope_for_layer(layer)
        if _unscored(rope):
            if scores is None:
                raise ConfigError(f"model.rope.select=2-norm (layer {layer}): needs calibration scores; convert from "
                                  "a source (`ropelab convert`, or `train.init_from`)")
            layer_scores = scores[layer].sum(0, keepdim=True).expand(K, -1) if config.qk_norm else scores[layer]
            kept = top_pairs(layer_scores, int(rope.keep_pairs))
            _set_layer_pairs(resolved, layer, kept if len({tuple(p) for p in kept}) > 1 else kept[0])
        elif rope.has_plan:
            kept = kept_pairs(rope, D, K)
            if config.qk_norm and any(heads != kept[0] for heads in kept):
                raise ConfigError(f"model.rope (layer {layer}): with model.qk_norm every KV head keeps the same "
                                  "pairs (the norm weight is shared by all heads)")
        elif rope.resolve_dims(D) in (0, D):
            kept = [list(range(rope.resolve_dims(D) // 2))] * K
        else:
            raise ConfigError(f"model.rope (layer {layer}): a full-RoPE source converts to a plan, NoPE or full "
                              f"RoPE; rotating {rope.resolve_dims(D)} of {D} channels by fraction is not one")
        plans.append(kept)
    if needs_scores(config):  # every 2-norm layer now has its own pairs: the base keeps no unscored plan
        resolved.rope = dataclasses.replace(resolved.rope, **dict.fromkeys(PLAN_KEYS))
    resolved.validate()
    return plans, resolved


def apply_plan(model: Transformer, config: ModelConfig, plans: Plans) -> Transformer:
    """A new model of `config` (from `resolve_plans`) holding `model`'s weights, with each attention head's
    channels permuted so that its kept pairs come first, in the layer's pair layout."""
    source = model.config
    D, H, K = source.head_size, source.n_head, source.kv_heads
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for layer, kept in enumerate(plans):
        layout = source.rope_for_layer(layer).layout
        orders = [channel_order(heads, D, layout) for heads in kept]
        rows = {"q": head_rows(orders, H, D), "k": head_rows(orders, K, D)}
        prefix = f"blocks.{layer}.attn"
        for which in ("q", "k"):
            for part in ("weight", "bias"):
                name = f"{prefix}.{which}_proj.{part}"
                if name in state:
                    state[name] = state[name][rows[which]]
            norm = f"{prefix}.{which}_norm.weight"
            if norm in state:  # shared by every head: `resolve_plans` gave all heads one plan
                state[norm] = state[norm][orders[0]]
    converted = Transformer(config, init=False)
    converted.load_state_dict(state)
    return converted.to(next(model.parameters()).dtype)


__all__ = ["Plans", "check_source", "target_config", "needs_scores", "shape_config", "resolve_plans", "apply_plan"]
