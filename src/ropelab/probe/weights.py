"""How W_q and W_k changed between two checkpoints, per layer, head and rotary frequency pair.

Row ``h * head_dim + c`` of a query (key) projection writes channel c of head h, so the rows
of a head split into its frequency pairs (two rows each, paired as the layer's layout says,
see `ropelab.probe.channels`) and its unrotated channels. For every such span the change is
``||W_B[rows] - W_A[rows]||_F / ||W_A[rows]||_F``: relative to the first checkpoint's own
norm of the same rows. Aggregates (per head, per pair over all heads, per layer) are the same
ratio over the union of their rows. Biases are left out.

Where a layer holds a selected-pair plan in either checkpoint (`ropelab.rope.pairs`), its
channels carry permuted *source pairs* (see `ropelab.probe.channels`): the rows of source pair i
in A are compared with the rows of source pair i in B, so a full-RoPE source and its conversion
(or two checkpoints of one plan) line up pair by pair. Such a layer is reported per head and
source pair, each flagged kept (rotated by the plan) or dropped, with aggregates over the kept
and over the dropped pairs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ropelab.config import ConfigError
from ropelab.mla.attention import LatentAttention
from ropelab.model import Transformer
from ropelab.probe.channels import LayerRope, layer_rope, pair_channels

PROJECTIONS = {"q": "q_proj", "k": "k_proj"}


def projection_weight(attention: torch.nn.Module, name: str) -> torch.Tensor:
    """The (heads * head_dim, d_model) weight of `name` (q_proj, k_proj); an MLA layer's keys: what its
    latent stands for (`LatentAttention.key_weight`)."""
    if name == "k_proj" and isinstance(attention, LatentAttention):
        return attention.key_weight()
    return getattr(attention, name).weight


def _ratio(delta_sq: torch.Tensor, base_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(delta_sq / base_sq) elementwise; NaN where the base is zero."""
    return torch.where(base_sq > 0, (delta_sq / base_sq.clamp_min(1e-300)).sqrt(), torch.full_like(base_sq, math.nan))


def _listed(x: torch.Tensor) -> list:
    return [None if v != v else v for v in x.tolist()] if x.dim() == 1 else [_listed(row) for row in x]


def projection_changes(w_a: torch.Tensor, w_b: torch.Tensor, heads: int, rope: LayerRope) -> dict:
    """Relative change of one projection (heads * head_dim, d_model), per head, pair and span."""
    base = w_a.double().reshape(heads, rope.head_dim, -1).pow(2).sum(-1)  # (H, D) squared row norms
    delta = (w_b.double() - w_a.double()).reshape(heads, rope.head_dim, -1).pow(2).sum(-1)
    pairs = pair_channels(rope.rotary_dims, rope.layout)  # (P, 2)
    unrotated = ~rope.rotated_mask
    base_pair, delta_pair = base[:, pairs].sum(-1), delta[:, pairs].sum(-1)  # (H, P)
    base_un, delta_un = base[:, unrotated].sum(-1), delta[:, unrotated].sum(-1)  # (H,)
    has_unrotated = bool(unrotated.any())
    return {
        "relative_change": float(_ratio(delta.sum(), base.sum())),
        "per_head": _listed(_ratio(delta.sum(-1), base.sum(-1))),
        "per_pair": _listed(_ratio(delta_pair.sum(0), base_pair.sum(0))),
        "unrotated": float(_ratio(delta_un.sum(), base_un.sum())) if has_unrotated else None,
        "per_head_pair": _listed(_ratio(delta_pair, base_pair)),
        "per_head_unrotated": _listed(_ratio(delta_un, base_un)) if has_unrotated else None,
    }


def _source_pair_rows(heads: int, groups: int, rope: LayerRope) -> torch.Tensor:
    """(heads, head_dim/2, 2) long: per head, the two rows of each source pair (head h is in KV group
    h // (heads/groups))."""
    group = heads // groups
    offsets = (torch.arange(heads) * rope.head_dim).view(-1, 1, 1)
    return torch.stack([rope.source_pair_channels(h // group) for h in range(heads)]) + offsets


def _kept_mask(heads: int, plan: LayerRope) -> torch.Tensor:
    """(heads, head_dim/2) bool: the source pairs the plan rotates in each head."""
    group = heads // len(plan.kept)
    kept = torch.zeros(heads, plan.head_dim // 2, dtype=torch.bool)
    for head in range(heads):
        kept[head, list(plan.kept[head // group])] = True
    return kept


def source_pair_changes(w_a: torch.Tensor, w_b: torch.Tensor, heads: int, rope_a: LayerRope, rope_b: LayerRope,
                        plan: LayerRope) -> dict:
    """Relative change of one projection per head and source pair, each checkpoint's rows of a pair
    found through its own channel map; `plan` (the checkpoint holding the plan) says which pairs are
    kept. ``unrotated`` is the change over the dropped pairs, the channels the plan passes through."""
    groups = len(plan.kept)
    rows_a, rows_b = _source_pair_rows(heads, groups, rope_a), _source_pair_rows(heads, groups, rope_b)
    base = w_a.double()[rows_a].pow(2).sum((-1, -2))  # (H, n)
    delta = (w_b.double()[rows_b] - w_a.double()[rows_a]).pow(2).sum((-1, -2))
    kept = _kept_mask(heads, plan)

    def over(mask: torch.Tensor) -> Optional[float]:
        return float(_ratio(delta[mask].sum(), base[mask].sum())) if bool(mask.any()) else None

    return {
        "relative_change": float(_ratio(delta.sum(), base.sum())),
        "per_head": _listed(_ratio(delta.sum(-1), base.sum(-1))),
        "per_pair": _listed(_ratio(delta.sum(0), base.sum(0))),
        "kept_pairs": over(kept), "dropped_pairs": over(~kept), "unrotated": over(~kept),
        "per_head_pair": _listed(_ratio(delta, base)),
        "kept": kept.tolist(),
    }


def _check_compatible(a: Transformer, b: Transformer) -> None:
    ca, cb = a.config, b.config
    for key in ("n_layer", "d_model", "n_head", "kv_heads", "head_size"):
        if getattr(ca, key) != getattr(cb, key):
            raise ConfigError(f"probe weights: the checkpoints differ in {key} ({getattr(ca, key)} vs {getattr(cb, key)}); compare two checkpoints of one model")
    for layer in range(ca.n_layer):
        ra, rb = layer_rope(ca, layer), layer_rope(cb, layer)
        if ra.kept is not None and rb.kept is not None and ra.kept != rb.kept:
            raise ConfigError(f"probe weights: layer {layer} keeps other pairs in the first checkpoint than in the "
                              "second; compare each with their full-RoPE source")
        if ra.layout == rb.layout and (ra.kept is not None or rb.kept is not None):
            partial = rb if ra.kept is not None else ra
            if not partial.maps_source_pairs:
                raise ConfigError(f"probe weights: layer {layer} holds a RoPE plan in one checkpoint and rotates "
                                  f"{partial.rotary_dims} of its {partial.head_dim} channels without one in the other; "
                                  "their frequency pairs do not correspond")
        elif (ra.rotary_dims, ra.layout) != (rb.rotary_dims, rb.layout):
            raise ConfigError(
                f"probe weights: layer {layer} rotates {ra.rotary_dims} channels ({ra.layout}) in the first checkpoint "
                f"and {rb.rotary_dims} ({rb.layout}) in the second; their frequency pairs do not correspond"
            )


def _span(layer: int, proj: str, head: int, pair: Optional[int], rope: LayerRope, value: float) -> dict:
    if pair is None:
        channels = [c for c in range(rope.head_dim) if c >= rope.rotary_dims]
        span, wavelength = "unrotated", None
    else:
        channels = pair_channels(rope.rotary_dims, rope.layout)[pair].tolist()
        span, wavelength = f"pair {pair}", rope.wavelengths[pair]
    return {
        "layer": layer, "proj": proj, "head": head, "span": span, "pair": pair, "channels": channels,
        "rows": [head * rope.head_dim + c for c in channels], "wavelength_tokens": wavelength,
        "relative_change": value,
    }


def _channel_spans(layer: int, proj: str, heads: int, rope: LayerRope, changes: dict) -> list[dict]:
    """The spans of a layer without a plan: each head's rotated pairs and its unrotated channels."""
    spans = []
    for head in range(heads):
        for pair, value in enumerate(changes["per_head_pair"][head]):
            spans.append(_span(layer, proj, head, pair, rope, value))
        if changes["per_head_unrotated"] is not None:
            spans.append(_span(layer, proj, head, None, rope, changes["per_head_unrotated"][head]))
    return spans


def _source_pair_spans(layer: int, proj: str, heads: int, ropes: tuple[LayerRope, LayerRope], plan: LayerRope,
                       changes: dict) -> list[dict]:
    """The spans of a plan layer: every source pair of every head, kept or dropped, with its rows in
    each checkpoint and its wavelength (`LayerRope.source_frequencies` of the plan)."""
    groups = len(plan.kept)
    rows_a, rows_b = (_source_pair_rows(heads, groups, rope).tolist() for rope in ropes)
    spans = []
    for head in range(heads):
        frequencies = plan.source_frequencies(head // (heads // groups))
        for pair, value in enumerate(changes["per_head_pair"][head]):
            kept = changes["kept"][head][pair]
            spans.append({
                "layer": layer, "proj": proj, "head": head, "span": f"pair {pair} ({'kept' if kept else 'dropped'})",
                "pair": pair, "kept": kept, "rows": rows_a[head][pair], "rows_b": rows_b[head][pair],
                "wavelength_tokens": 2 * math.pi / frequencies[pair], "relative_change": value,
            })
    return spans


def weight_changes(a: Transformer, b: Transformer, top: int = 10) -> dict:
    """The change of every layer's W_q and W_k from model `a` to model `b`, the `top` spans
    (layer, projection, head, frequency pair or unrotated channels; a source pair in plan layers)
    that changed most, and a (layer x pair, plus one unrotated column) heatmap per projection."""
    _check_compatible(a, b)
    config = a.config
    layers, spans = [], []
    heatmap: dict[str, list] = {proj: [] for proj in PROJECTIONS}
    for layer in range(config.n_layer):
        rope, rope_b = layer_rope(config, layer), layer_rope(b.config, layer)
        plan = rope_b if rope_b.kept is not None else rope if rope.kept is not None else None
        entry = {"layer": layer, "rotary_dims": rope.rotary_dims, "layout": rope.layout, "theta_a": rope.theta,
                 "theta_b": rope_b.theta, "wavelengths_a": list(rope.wavelengths), "wavelengths_b": list(rope_b.wavelengths)}
        if plan is not None:  # per KV head: the kept source pairs and every source pair's wavelength
            entry |= {"rotary_dims_b": rope_b.rotary_dims, "plan": [list(p) for p in plan.kept],
                      "pair_wavelengths": [[2 * math.pi / f for f in plan.source_frequencies(g)]
                                           for g in range(len(plan.kept))]}
        for proj, attr in PROJECTIONS.items():
            heads = config.n_head if proj == "q" else config.kv_heads
            w_a, w_b = (projection_weight(model.blocks[layer].attn, attr).detach() for model in (a, b))
            if plan is None:
                changes = projection_changes(w_a, w_b, heads, rope)
                spans += _channel_spans(layer, proj, heads, rope, changes)
            else:
                changes = source_pair_changes(w_a, w_b, heads, rope, rope_b, plan)
                spans += _source_pair_spans(layer, proj, heads, (rope, rope_b), plan, changes)
            entry[proj] = changes
            heatmap[proj].append(changes["per_pair"] + [changes["unrotated"]])
        layers.append(entry)
    ranked = sorted((s for s in spans if s["relative_change"] is not None), key=lambda s: -s["relative_change"])
    return {"layers": layers, "top_spans": ranked[:top], "heatmap": heatmap}
