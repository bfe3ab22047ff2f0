"""Branches (`train.branch_from`): a new run that continues another run's full training state.

A branch loads a checkpoint's weights, optimizer moments, step count and RNG, reads the data from
the same position (the loader is a pure function of the seed and the step), and goes on with its
own schedule: a branch from step 10 with `train.steps: 20` trains and logs steps 11-20. With the
parent's own schedule it repeats the parent's next steps bit for bit; with another (a cooldown, a
changed setting) it is an ablation from a shared trunk. `init_from` is the other way to start from
a run: weights only, with a fresh optimizer and data from the start.

  branch_point(config)  the checkpoint the run branches from, checked: same weight shapes,
                        tokenizer and per-layer RoPE and attention as the parent, more steps than
                        the branch point, and a checkpoint the parent, if it is still training,
                        keeps for good; one ConfigError line otherwise, before the run directory
                        is made

A branch keeps its parent's model as trained: `ropelab train` takes the parent's model settings and
tokenizer as its defaults (`ropelab.sources.init.run_config`), and a branch whose layers would rotate
or attend otherwise (a preset's layout, fraction or theta) is refused, since it would not continue
what the parent learnt; `init_from` starts a run with other model settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError, ModelConfig, RunConfig
from ropelab.sources.init import check_same_weights
from ropelab.sources.runs import checkpoint_config, checkpoint_step, is_run_dir
from ropelab.train import checkpoint as ckpt
from ropelab.train.lock import is_locked


@dataclass(frozen=True)
class BranchPoint:
    checkpoint: Path
    step: int

    def record(self) -> dict:
        """What result.json keeps of it."""
        return {"source": str(self.checkpoint.parent.parent), "checkpoint": str(self.checkpoint), "step": self.step}


def _key(config: RunConfig) -> str:
    return f"train.branch_from={config.train.branch_from!r}"


def _checkpoint(config: RunConfig) -> Optional[Path]:
    """The checkpoint folder `config` names (None: its run has no complete checkpoint yet)."""
    source, step = Path(config.train.branch_from), config.train.branch_step
    if is_run_dir(source):
        return ckpt.step_dir(source, step) if step is not None else ckpt.latest_checkpoint(source)
    if step is not None:
        raise ConfigError(f"train.branch_step={step}: picks a checkpoint of a run; {_key(config)} is not a run folder")
    return source


def _layer_settings(model: ModelConfig, layer: int) -> dict:
    """What decides how `layer` rotates and attends, by name: its RoPE settings (channels as the count
    rotated, however the config says it), attention window and query temperature."""
    rope, kind = model.rope_for_layer(layer), model.layer_kind(layer)
    settings = {f"rope.{name}": value for name, value in dataclasses.asdict(rope).items()
                if name not in ("fraction", "rotary_dims")}
    return settings | {"rotary channels": rope.resolve_dims(model.head_size), "attention": kind.attention,
                       "window": kind.window, "temperature": kind.temperature}


def _check_same_layers(config: RunConfig, parent: RunConfig, key: str) -> None:
    if config.model.norm_eps != parent.model.norm_eps:
        raise ConfigError(f"{key}: model.norm_eps={config.model.norm_eps!r} but the parent has {parent.model.norm_eps!r}; "
                          "a branch continues the parent's model as trained")
    for layer in range(config.model.n_layer):
        mine, theirs = _layer_settings(config.model, layer), _layer_settings(parent.model, layer)
        for name, value in mine.items():
            if value != theirs[name]:
                raise ConfigError(f"{key}: layer {layer} has {name} {value!r} but the parent's has {theirs[name]!r}; a "
                                  "branch continues the parent's model as trained (its layout, RoPE and attention per "
                                  "layer): drop the change, or start a new run from its weights with train.init_from")


def branch_point(config: RunConfig) -> BranchPoint:
    """The checkpoint `config` branches from, after checking that the branch can continue it."""
    folder = _checkpoint(config)
    holder = is_locked(Path(config.train.branch_from) if folder is None else folder.parent.parent)
    if holder and not (folder is not None and (folder / ckpt.MARKER).is_file() and ckpt.kept_for_good(folder)):
        raise ConfigError(f"{_key(config)}: the parent is still training ({holder}); branch once it has finished, "
                          "or from a step of its train.checkpoint_steps once written (a checkpoint it may still "
                          "write or prune is not one to branch from)")
    if folder is None:
        raise ConfigError(f"{_key(config)}: the run has no complete checkpoint yet")
    if not (folder / ckpt.MARKER).is_file():
        kept = ", ".join(str(checkpoint_step(p)) for p in ckpt.list_checkpoints(folder.parent.parent)) or "none"
        raise ConfigError(f"{_key(config)}: no complete checkpoint at {folder} (the run keeps steps: {kept}; "
                          "train.checkpoint_steps keeps the ones to branch from)")
    try:
        parent, folder = checkpoint_config(folder)
    except ConfigError as exc:
        raise ConfigError(f"{_key(config)}: {exc}") from None
    check_same_weights(config, parent, _key(config))
    _check_same_layers(config, parent, _key(config))
    step = checkpoint_step(folder)
    if config.train.steps <= step:
        raise ConfigError(f"train.steps={config.train.steps}: a branch from step {step} must train further "
                          f"(steps count on from the parent's)")
    return BranchPoint(folder, step)


__all__ = ["BranchPoint", "branch_point"]
