"""What a probe runs: the probe sequence's shape, the modes, layers and stages.

`ProbeConfig.validate` raises a one-line `ConfigError` naming the option, like the run
configuration in `ropelab.config` (kept here, beside the probe, so the run config stays about
training runs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from ropelab.config import ConfigError

# The seed's probe: BOS, 2,046 content tokens, EOS, repeated 64 times (Huber et al. 2026, Sec. 4).
SEED_BLOCK_LEN = 2048
SEED_REPEATS = 64

# Capture stages in forward order. Per-layer stages are recorded for every selected layer.
MODEL_STAGES = ("embed", "final", "logits")
LAYER_STAGES = ("q_pre", "k_pre", "q_post", "k_post", "block")
STAGES = ("embed", "q_pre", "k_pre", "q_post", "k_post", "block", "final", "logits")

# Each mode axis with its allowed values; the first value is the seed's setting.
MODE_AXES = {
    "attention": ("causal", "doc"),
    "precision": ("fp32", "bf16"),
    "positions": ("running", "restart"),
}


@dataclass(frozen=True)
class ProbeMode:
    """One way to run the probe forward.

    attention: ``causal`` lets every repeat attend to all earlier ones (the seed); ``doc`` masks
    attention to the repeat itself. precision: weights and activations in ``fp32`` or ``bf16``.
    positions: ``running`` over the whole window (the seed) or ``restart`` at every repeat."""

    attention: str = "causal"
    precision: str = "fp32"
    positions: str = "running"

    @property
    def name(self) -> str:
        return f"{self.attention}-{self.precision}-{self.positions}"


ALL_MODES = tuple(ProbeMode(*values) for values in itertools.product(*MODE_AXES.values()))


def parse_mode(text: str) -> ProbeMode:
    """``"doc-restart"`` -> ProbeMode("doc", "fp32", "restart"): dash-separated words, any order,
    one per axis at most; an axis not named keeps the seed's setting."""
    chosen: dict[str, str] = {}
    for word in text.strip().lower().split("-"):
        axis = next((a for a, values in MODE_AXES.items() if word in values), None)
        if axis is None:
            allowed = ", ".join(v for values in MODE_AXES.values() for v in values)
            raise ConfigError(f"--modes {text!r}: unknown word {word!r}; use words from {allowed}, or all")
        if axis in chosen:
            raise ConfigError(f"--modes {text!r}: names {axis} twice ({chosen[axis]} and {word})")
        chosen[axis] = word
    return ProbeMode(**chosen)


def parse_modes(text: str) -> tuple[ProbeMode, ...]:
    """A comma-separated list of modes (see `parse_mode`) or ``all`` (every combination)."""
    if text.strip().lower() == "all":
        return ALL_MODES
    modes = [parse_mode(part) for part in text.split(",") if part.strip()]
    if not modes:
        raise ConfigError("--modes: empty; name at least one mode, e.g. causal-fp32-running, or all")
    return tuple(dict.fromkeys(modes))


def parse_layers(text: str) -> Optional[tuple[int, ...]]:
    """``all`` -> None (every layer); ``"0,2,-1"`` -> (0, 2, -1), negative counting from the end."""
    if text.strip().lower() == "all":
        return None
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--layers {text!r}: expected all or comma-separated layer indices, e.g. 0,3,-1") from None
    if not layers:
        raise ConfigError("--layers: empty; give all or layer indices")
    return layers


def parse_stages(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "all":
        return STAGES
    stages = tuple(part.strip() for part in text.split(",") if part.strip())
    for stage in stages:
        if stage not in STAGES:
            raise ConfigError(f"--stages: unknown stage {stage!r}; choose from {', '.join(STAGES)}, or all")
    if not stages:
        raise ConfigError("--stages: empty; give all or stage names")
    return tuple(s for s in STAGES if s in stages)  # forward order


@dataclass
class ProbeConfig:
    """The probe sequence (`block_len` tokens: BOS, block_len - 2 content tokens, EOS; repeated
    `repeats` times), where the content comes from (`text_file`, else the validation split of
    the first checkpoint's corpus), and what is captured."""

    block_len: int = SEED_BLOCK_LEN
    repeats: int = SEED_REPEATS
    text_file: Optional[str] = None
    modes: tuple[ProbeMode, ...] = (ProbeMode(),)
    layers: Optional[tuple[int, ...]] = None  # None: every layer
    stages: tuple[str, ...] = STAGES
    device: str = "auto"
    progress: bool = True
    top_spans: int = 10  # weight-update spans listed as "changed most"

    def validate(self) -> "ProbeConfig":
        if self.block_len < 3:
            raise ConfigError(f"--block-len={self.block_len}: must be >= 3 (BOS, at least one content token, EOS)")
        if self.repeats < 2:
            raise ConfigError(f"--repeats={self.repeats}: must be >= 2 (repeats are compared with the first)")
        if not self.modes:
            raise ConfigError("--modes: empty; name at least one mode")
        for mode in self.modes:
            for axis, allowed in MODE_AXES.items():
                if getattr(mode, axis) not in allowed:
                    raise ConfigError(f"--modes {mode.name}: {axis} must be one of {', '.join(allowed)}")
        for stage in self.stages:
            if stage not in STAGES:
                raise ConfigError(f"--stages: unknown stage {stage!r}; choose from {', '.join(STAGES)}")
        if self.top_spans < 1:
            raise ConfigError(f"--top={self.top_spans}: must be >= 1")
        return self

    @property
    def window(self) -> int:
        return self.block_len * self.repeats

    def layer_indices(self, n_layer: int) -> tuple[int, ...]:
        """The selected layers as indices in [0, n_layer), in order; ConfigError for one out of range."""
        if self.layers is None:
            return tuple(range(n_layer))
        resolved = []
        for layer in self.layers:
            index = layer + n_layer if layer < 0 else layer
            if not 0 <= index < n_layer:
                raise ConfigError(f"--layers: layer {layer} out of range for a model with {n_layer} layers")
            resolved.append(index)
        return tuple(sorted(set(resolved)))
