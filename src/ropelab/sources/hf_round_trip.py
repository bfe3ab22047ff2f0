"""The gate of a native export: the transformers config written from a ropelab model
(`hf_config_write.hf_config_for`), read back by ropelab's own importer
(`hf_config_read.model_config_from_hf`), must describe the same model, layer by layer.

  native_architecture(config)   the HF model_type to export `config` natively as, or a ValueError
                                naming the obstacles (`hf_architecture`'s deny-list) or every setting
                                the round trip changes
  round_trip_changes(config)    the settings whose value the round trip changes, one line each

A position encoding whose registered type claims no HF class (`hf_native`) is refused first. The
deny-list of `hf_config_write` gives readable reasons for the differences it knows; the round trip
catches the ones it does not (a setting added to `ModelConfig`, `RopeConfig` or `LayerKind` later, a
position encoding no HF class has): every field of those dataclasses is compared, except the ones
`ALLOWED` lists with the reason the logits do not depend on them. A layer is compared as it computes
(its resolved RoPE and layer kind), so spellings that mean the same model (a fraction or its channel
count, a pattern of kinds or per-layer overrides) compare equal.
"""

from __future__ import annotations

import dataclasses

from ropelab.config import ConfigError, ModelConfig
from ropelab.sources.hf_config_read import model_config_from_hf
from ropelab.sources.hf_config_write import hf_architecture, hf_config_for

# settings that differ after the round trip without changing the logits, and why
ALLOWED = {
    "name": "a label",
    "init_std": "initialisation only, before any weight is loaded",
    "max_seq_len": "a capacity (HF's dynamic NTK grows from max_position_embeddings, so it is rewritten)",
    "rope.cache": "a cos/sin table or computing them per call is the same arithmetic",
    "rope.angles": "the precision position x frequency is formed in; HF forms it in float32",
    "rope.scaling.original_max_position of linear": "linear interpolation divides by its factor alone",
}
# how a model is spelled rather than what it computes: replaced by each layer's resolved settings
_SPELLINGS = ("rope", "rope_layers", "layer_pattern", "layer_kinds", "position", "position_layers", "n_kv_head",
              "head_dim")
# RoPE settings that mean nothing on a layer rotating no channel
_ROTATION_ONLY = ("theta", "style", "layout", "scaling", "keep_pairs", "select", "pairs")


def _layer(config: ModelConfig, layer: int) -> dict:
    """What layer `layer` computes: its RoPE (channel count resolved, static NTK as the base it amounts
    to, rotation settings only where channels rotate) and its layer kind (less its RoPE override)."""
    D = config.head_size
    rope = config.rope_for_layer(layer)
    rotary_dims = rope.resolve_dims(D)
    resolved = dataclasses.asdict(rope) | {"fraction": None, "rotary_dims": rotary_dims}
    if rope.scaling is not None and rope.scaling.method == "ntk":  # exactly a change of base
        resolved |= {"theta": rope.theta * rope.scaling.factor ** (rotary_dims / (rotary_dims - 2)), "scaling": None}
    if rotary_dims == D and not rope.has_plan:
        resolved["style"] = None  # slice and truncate give a full head the same frequencies
    if not rotary_dims:
        resolved |= dict.fromkeys(_ROTATION_ONLY)
    scaling = resolved.pop("scaling") or {}
    if scaling.get("method") == "linear":
        scaling["original_max_position"] = None
    resolved |= {f"scaling.{key}": value for key, value in scaling.items()}
    kind = dataclasses.asdict(config.layer_kind(layer)) | {"rope": None, "position": None}  # resolved below
    positions = [f"{entry.type.name} {dataclasses.asdict(entry.spec)}" for entry in config.positions_for_layer(layer)]
    return {"position": positions} | {f"rope.{key}": value for key, value in resolved.items() if f"rope.{key}" not in ALLOWED} | {
        f"kind.{key}": value for key, value in kind.items()}


def _computed(config: ModelConfig) -> dict:
    """`config` as a flat {setting: value} of what the model computes ("layers.3.rope.theta")."""
    top = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
           if field.name not in _SPELLINGS and field.name not in ALLOWED}
    top |= {"kv_heads": config.kv_heads, "head_size": config.head_size}
    for layer in range(config.n_layer):
        top |= {f"layers.{layer}.{key}": value for key, value in _layer(config, layer).items()}
    return top


def round_trip_changes(config: ModelConfig) -> list[str]:
    """The settings of `config` the HF config written from it does not bring back, as
    ``"setting: ours -> read back"`` (layers with the same change listed once)."""
    try:
        back = model_config_from_hf(hf_config_for(config))
    except ConfigError as exc:
        return [f"the HF config written does not read back ({exc})"]
    ours, theirs = _computed(config), _computed(back)
    changes: dict[str, list[str]] = {}
    for key in sorted(ours.keys() | theirs.keys(), key=lambda k: (k.split(".")[-1], k)):
        if ours.get(key, "absent") != theirs.get(key, "absent"):
            layer, _, setting = key.partition(".")[2].partition(".") if key.startswith("layers.") else ("", "", key)
            line = f"{setting}: {ours.get(key, 'absent')!r} -> {theirs.get(key, 'absent')!r}"
            changes.setdefault(line, []).append(layer)
    return [line + (f" (layers {', '.join(layers)})" if layers != [""] else "") for line, layers in changes.items()]


def native_architecture(config: ModelConfig) -> str:
    """The HF model_type `config` exports as natively: every position encoding claims an HF class
    (`hf_native`, `ropelab.config.position`), no obstacle on the deny-list and an exact round trip."""
    unclaimed = sorted({entry.type.name for layer in range(config.n_layer) for entry in config.positions_for_layer(layer)
                        if not entry.type.hf_native})
    if unclaimed:
        raise ValueError(f"cannot export {config.name!r} natively: no Hugging Face class computes position "
                         f"encoding {', '.join(unclaimed)} (model.position)")
    name = hf_architecture(config)
    changes = round_trip_changes(config)
    if changes:
        raise ValueError(f"cannot export {config.name!r} natively: its Hugging Face config reads back as another "
                         "model (" + "; ".join(changes) + ")")
    return name


__all__ = ["ALLOWED", "native_architecture", "round_trip_changes"]
