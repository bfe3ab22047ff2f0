"""The modules of the registered position encodings, found by `type` (see `ropelab.position`)."""

from __future__ import annotations

from torch import nn

from ropelab.config.position import POSITION_TYPES
from ropelab.position.alibi import Alibi
from ropelab.position.fope import FourierEmbedding
from ropelab.rope.embedding import RotaryEmbedding

ROTATIONS = {
    "rope": lambda rope, spec, head_dim, kv_heads: RotaryEmbedding(rope, head_dim, kv_heads),
    "nope": lambda rope, spec, head_dim, kv_heads: RotaryEmbedding(rope, head_dim, kv_heads),
    "fope": FourierEmbedding,
}
SCORE_BIASES = {"alibi": Alibi}


def rebuild_after_meta(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "rebuild_after_meta"):
            module.rebuild_after_meta()


def position_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of learned position encodings (declared `learned` in the registry)."""
    return {id(p) for module in model.modules() if POSITION_TYPES.get(getattr(module, "position_type", None)) and
            POSITION_TYPES[module.position_type].learned for p in module.parameters()}


__all__ = ["ROTATIONS", "SCORE_BIASES", "position_parameters", "rebuild_after_meta"]
