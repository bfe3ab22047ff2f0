"""The modules of the registered position encodings, found by `type` (see `ropelab.position`)."""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from ropelab.config.model import ModelConfig
from ropelab.config.position import POSITION_TYPES, Position
from ropelab.config.rope import RopeConfig
from ropelab.position.alibi import Alibi
from ropelab.position.fope import FourierEmbedding
from ropelab.rope.embedding import RotaryEmbedding

ROTATIONS = {
    "rope": lambda rope, spec, head_dim, kv_heads: RotaryEmbedding(rope, head_dim, kv_heads),
    "nope": lambda rope, spec, head_dim, kv_heads: RotaryEmbedding(rope, head_dim, kv_heads),
    "fope": FourierEmbedding,
}
SCORE_BIASES = {"alibi": Alibi}
ATTENTIONS: dict[str, type[nn.Module]] = {}  # none shipped; tests/position registers one


def rotation_setting(config: ModelConfig, layer: int) -> tuple[str, RopeConfig, Position]:
    """(what layers with one rotation module share, the layer's RoPE setting, its rotation entry): equal
    settings share a module, a learned one (FoPE) is the layer's own."""
    rope, (rotation, *_) = config.rope_for_layer(layer), config.positions_for_layer(layer)
    key = repr((rotation.type.name, rotation.spec, dataclasses.astuple(rope)))
    return key + (f" layer {layer}" if rotation.type.learned else ""), rope, rotation


def build_rotation(config: ModelConfig, layer: int) -> RotaryEmbedding:
    """The layer's rotation module (its own copy of the RoPE setting: a phase's theta switch changes the
    module, not `config`)."""
    _, rope, rotation = rotation_setting(config, layer)
    return ROTATIONS[rotation.type.name](copy.deepcopy(rope), rotation.spec, config.head_size, config.kv_heads)


def rebuild_after_meta(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "rebuild_after_meta"):
            module.rebuild_after_meta()


def position_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of learned position encodings (declared `learned` in the registry)."""
    return {id(p) for module in model.modules() if POSITION_TYPES.get(getattr(module, "position_type", None)) and
            POSITION_TYPES[module.position_type].learned for p in module.parameters()}


__all__ = ["ATTENTIONS", "ROTATIONS", "SCORE_BIASES", "build_rotation", "position_parameters", "rebuild_after_meta",
           "rotation_setting"]
