"""Settings of `ropelab convert`: which pairs to keep, the per-layer layout, the calibration data and the
held-out check."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from ropelab.config import ConfigError, LayerKind, from_dict, parse_override, set_dotted
from ropelab.config.checks import SEED_MAX, TOKENS_MAX, check_ints
from ropelab.config.mla import INITS as MLA_INITS
from ropelab.rope.pairs import STRATEGIES


@dataclass
class PlanConfig:
    """`keep_pairs` (r) of each KV head's head_dim/2 pairs, chosen by `select`: high, low, uniform,
    2-norm (MHA2MLA's score on the calibration data) or ``list`` (`pairs`: one entry per layer, a list
    of pair indices or one list per KV head)."""

    keep_pairs: Optional[int] = None
    select: str = "2-norm"
    pairs: Optional[list] = None


@dataclass
class LayoutConfig:
    """The converted model's layer kinds, as `model.layer_pattern` and `model.layer_kinds` of a run config
    (`ropelab.config.layout`); the pattern stays the source's when only kinds are given. A kind with
    ``rope: none`` stops rotating (the same weights, NoPE), one with ``rope: {keep_pairs: 4, select: high}``
    keeps its own plan; layers of kinds without `rope` take `rope` above."""

    layer_pattern: Optional[str] = None
    layer_kinds: dict[str, LayerKind] = field(default_factory=dict)

    @property
    def given(self) -> bool:
        return self.layer_pattern is not None or bool(self.layer_kinds)


@dataclass
class CalibrationConfig:
    """Tokens of the training split of `corpus` (any corpus ropelab reads: stdlib or a prepared folder in
    the source's tokenizer), in `seq_len` windows, sampled deterministically for `seed`."""

    corpus: str = "stdlib"
    tokens: int = 65_536
    seq_len: int = 512
    seed: int = 0


@dataclass
class HeldOutConfig:
    """The check right after conversion: loss and KL to the source on the first `tokens` of the
    calibration corpus's validation split."""

    tokens: int = 16_384
    seq_len: int = 512
    micro_batch: int = 2


@dataclass
class LatentConfig:
    """Multi-head latent attention after the plan (`ropelab.mla`): `rank` (d) latent values per KV head, None
    for none; `init` svd-joint (MHA2MLA's) or svd-split (`ropelab.mla.convert`)."""

    rank: Optional[int] = None
    init: str = "svd-joint"


@dataclass
class ConvertConfig:
    rope: PlanConfig = field(default_factory=PlanConfig)
    model: LayoutConfig = field(default_factory=LayoutConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    mla: LatentConfig = field(default_factory=LatentConfig)

    def validate(self, head_dim: int) -> None:
        n_pairs = head_dim // 2
        plan = self.rope
        if plan.select not in (*STRATEGIES, "list"):
            raise ConfigError(f"rope.select={plan.select!r}: unknown; choose one of {', '.join(STRATEGIES)}, list")
        if plan.select == "list":
            if plan.pairs is None:
                raise ConfigError("rope.select=list: give the pairs as rope.pairs (one entry per layer)")
        elif plan.pairs is not None:
            raise ConfigError(f"rope.pairs: only with rope.select=list (rope.select={plan.select} chooses them)")
        elif plan.keep_pairs is None:  # with model.layer_kinds: no plan, the other layers keep full RoPE
            if not self.model.given:
                raise ConfigError(f"rope.keep_pairs: required (how many of the {n_pairs} pairs per KV head to keep), "
                                  "unless model.layer_kinds changes only some layers")
        elif isinstance(plan.keep_pairs, bool) or not 0 <= plan.keep_pairs <= n_pairs:
            raise ConfigError(f"rope.keep_pairs={plan.keep_pairs}: must be an integer in 0..{n_pairs} "
                              f"(head_dim {head_dim} has {n_pairs} pairs)")
        if self.mla.init not in MLA_INITS:
            raise ConfigError(f"mla.init={self.mla.init!r}: unknown; choose one of {', '.join(MLA_INITS)}")
        for name, section in (("calibration", self.calibration), ("eval", self.eval)):
            check_ints(name, section, ("tokens",), high=TOKENS_MAX)
            check_ints(name, section, ("seq_len", "micro_batch") if section is self.eval else ("seq_len",))
        check_ints("calibration", self.calibration, ("seed",), low=0, high=SEED_MAX)


def convert_config(tree: Optional[dict] = None, overrides=()) -> ConvertConfig:
    """A ConvertConfig from a YAML dict and dotted key=value overrides (not yet validated: that needs
    the source's head_dim)."""
    tree = copy.deepcopy(tree) if tree else {}
    for text in overrides:
        set_dotted(tree, *parse_override(text))
    return from_dict(ConvertConfig, tree)


__all__ = ["ConvertConfig", "LatentConfig", "PlanConfig", "LayoutConfig", "CalibrationConfig", "HeldOutConfig", "convert_config"]
