"""From a captures file to its metrics and heatmap data, and from several checkpoints' metrics
to a comparison.

One entry per captured tensor (a stage, or a stage of one layer): the per-repeat distances to
the first repeat, their mean and maximum, the variance across repeats (for queries and keys
split into rotated and unrotated channels), and for the logits the per-repeat KL divergence.
With `model.layer_pattern`, the per-layer entries are also averaged per layer kind (`by_layer_kind`).
The comparison puts each scalar of every checkpoint side by side, with its difference from
the first checkpoint (the reference), per mode.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Iterator, Optional

import torch

from ropelab.probe import metrics
from ropelab.probe.channels import LayerRope
from ropelab.probe.config import STAGES

ROTARY_STAGES = ("q_pre", "k_pre", "q_post", "k_post")
SCALARS = (
    "mean_cosine_distance", "mean_relative_l2", "max_relative_l2", "variance", "variance_rotated",
    "variance_unrotated", "mean_kl", "max_kl",
)
KIND_SCALARS = ("mean_relative_l2", "mean_cosine_distance")  # averaged over the layers of a kind


def split_name(name: str) -> tuple[str, Optional[int]]:
    """``"q_post.3"`` -> ("q_post", 3); ``"logits"`` -> ("logits", None)."""
    stage, _, layer = name.partition(".")
    return stage, int(layer) if layer else None


def ordered_names(names) -> list[str]:
    """Capture names grouped by stage (stages in forward order), layers ascending within a stage."""
    return sorted(names, key=lambda n: (STAGES.index(split_name(n)[0]), split_name(n)[1] or 0))


def read_captures(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every capture in the file (`ordered_names` order), one tensor in memory at a time."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in ordered_names(f.keys()):
            yield name, f.get_tensor(name)


def entry_metrics(stage: str, x: torch.Tensor, rope: Optional[LayerRope] = None) -> dict:
    """Metrics of one captured tensor x (R, ...) of `stage`; `rope` for the queries and keys."""
    cosine = metrics.cosine_distance_to_first(x)
    rel = metrics.relative_l2_to_first(x)
    variance = metrics.channel_variance(x)
    entry = {
        "cosine_distance": cosine.tolist(), "relative_l2": rel.tolist(),
        "mean_cosine_distance": float(cosine[1:].mean()), "mean_relative_l2": float(rel[1:].mean()),
        "max_relative_l2": float(rel[1:].max()), "variance": float(variance.mean()),
    }
    if stage in ROTARY_STAGES and rope is not None:
        split = metrics.split_variance(variance, rope.rotated_mask)
        entry |= {"variance_rotated": split["rotated"], "variance_unrotated": split["unrotated"],
                  "rotary_dims": rope.rotary_dims}
    if stage == "logits":
        kl = metrics.kl_to_first(x)
        entry |= {"kl": kl.tolist(), "mean_kl": float(kl[1:].mean()), "max_kl": float(kl[1:].max())}
    return entry


def analyse_captures(path: str | Path, ropes: dict[int, LayerRope]) -> tuple[dict[str, dict], dict[str, list]]:
    """One pass over a captures file: ({capture name: metrics}, {stage: heatmap panels}); a panel
    is (title, deviation (channels, R) from `metrics.deviation_from_first`, rotary_dims or None).
    `ropes` maps a layer index to its RoPE."""
    found, panels = {}, {}
    for name, x in read_captures(path):
        stage, layer = split_name(name)
        rope = ropes.get(layer) if layer is not None else None
        found[name] = entry_metrics(stage, x, rope)
        rotary_dims = rope.rotary_dims if stage in ROTARY_STAGES and rope is not None else None
        title = stage if layer is None else f"layer {layer}"
        panels.setdefault(stage, []).append((title, metrics.deviation_from_first(x), rotary_dims))
    return found, panels


def by_layer_kind(found: dict[str, dict], kinds: dict[int, str]) -> dict[str, dict]:
    """{kind: {"layers": [...], stage: {scalar: mean over the kind's layers}}} of the per-layer captures in
    `found`, for `KIND_SCALARS`; `kinds` maps each probed layer to its kind in `model.layer_pattern`."""
    grouped: dict[str, dict] = {}
    for name, entry in found.items():
        stage, layer = split_name(name)
        if layer is None:
            continue
        group = grouped.setdefault(kinds[layer], {"layers": set(), "stages": {}})
        group["layers"].add(layer)
        for key in KIND_SCALARS:
            group["stages"].setdefault(stage, {}).setdefault(key, []).append(entry[key])
    return {kind: {"layers": sorted(group["layers"])}
            | {stage: {key: fmean(values) for key, values in scalars.items()} for stage, scalars in group["stages"].items()}
            for kind, group in sorted(grouped.items())}


def compare(metrics_by_checkpoint: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """{capture name: {"values": {checkpoint: {scalar: v}}, "difference": {checkpoint: {scalar: v - ref}},
    "relative_l2_difference": {checkpoint: per-repeat curve - ref's}}} for the names every
    checkpoint has; the first checkpoint is the reference."""
    labels = list(metrics_by_checkpoint)
    reference = labels[0]
    shared = set.intersection(*(set(m) for m in metrics_by_checkpoint.values()))
    out = {}
    for name in ordered_names(shared):
        values = {
            label: {k: metrics_by_checkpoint[label][name][k] for k in SCALARS if k in metrics_by_checkpoint[label][name]}
            for label in labels
        }
        ref = values[reference]
        out[name] = {
            "values": values,
            "difference": {
                label: {k: (v - ref[k] if v is not None and ref.get(k) is not None else None) for k, v in values[label].items()}
                for label in labels[1:]
            },
            "relative_l2_difference": {
                label: [b - a for a, b in zip(metrics_by_checkpoint[reference][name]["relative_l2"],
                                              metrics_by_checkpoint[label][name]["relative_l2"])]
                for label in labels[1:]
            },
        }
    return out
