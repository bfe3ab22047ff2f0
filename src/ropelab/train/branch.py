"""Branches (`train.branch_from`): a new run that continues another run's full training state.

A branch loads a checkpoint's weights, optimizer moments, step count and RNG, reads the data from
the same position (the loader is a pure function of the seed and the step), and goes on with its
own schedule: a branch from step 10 with `train.steps: 20` trains and logs steps 11-20. With the
parent's own schedule it repeats the parent's next steps bit for bit; with another (a cooldown, a
changed setting) it is an ablation from a shared trunk. `init_from` is the other way to start from
a run: weights only, with a fresh optimizer and data from the start.

  branch_point(config)  the checkpoint the run branches from, checked: same weight shapes and
                        tokenizer as the parent, and more steps than the branch point; one
                        ConfigError line otherwise, before the run directory is made
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ropelab.config import ConfigError, RunConfig
from ropelab.sources.init import check_same_weights
from ropelab.sources.runs import checkpoint_config, checkpoint_step, is_run_dir
from ropelab.train import checkpoint as ckpt


@dataclass(frozen=True)
class BranchPoint:
    checkpoint: Path
    step: int

    def record(self) -> dict:
        """What result.json keeps of it."""
        return {"source": str(self.checkpoint.parent.parent), "checkpoint": str(self.checkpoint), "step": self.step}


def _key(config: RunConfig) -> str:
    return f"train.branch_from={config.train.branch_from!r}"


def _checkpoint(config: RunConfig) -> Path:
    source, step = Path(config.train.branch_from), config.train.branch_step
    if is_run_dir(source):
        if step is not None:
            return ckpt.step_dir(source, step)
        latest = ckpt.latest_checkpoint(source)
        if latest is None:
            raise ConfigError(f"{_key(config)}: the run has no complete checkpoint yet")
        return latest
    if step is not None:
        raise ConfigError(f"train.branch_step={step}: picks a checkpoint of a run; {_key(config)} is not a run folder")
    return source


def branch_point(config: RunConfig) -> BranchPoint:
    """The checkpoint `config` branches from, after checking that the branch can continue it."""
    folder = _checkpoint(config)
    if not (folder / ckpt.MARKER).is_file():
        kept = ", ".join(str(checkpoint_step(p)) for p in ckpt.list_checkpoints(folder.parent.parent)) or "none"
        raise ConfigError(f"{_key(config)}: no complete checkpoint at {folder} (the run keeps steps: {kept}; "
                          "train.checkpoint_steps keeps the ones to branch from)")
    try:
        parent, folder = checkpoint_config(folder)
    except ConfigError as exc:
        raise ConfigError(f"{_key(config)}: {exc}") from None
    check_same_weights(config, parent, _key(config))
    step = checkpoint_step(folder)
    if config.train.steps <= step:
        raise ConfigError(f"train.steps={config.train.steps}: a branch from step {step} must train further "
                          f"(steps count on from the parent's)")
    return BranchPoint(folder, step)


__all__ = ["BranchPoint", "branch_point"]
