"""A run as a sequence of phases, each a full `RunConfig` of its own.

A run without `train.phases` is one phase of `train.steps` steps. With phases, phase i is the
run's config with the phase's dotted overrides applied, covering global steps [start, end); its
LR schedule (warm-up, then cosine or warmup-stable-decay) restarts at `start`, its data loader
counts samples from the phase start, and its RoPE theta and scaling are set on the model when the
phase begins.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ropelab.config import ConfigError, RunConfig, build_run_config, set_dotted


@dataclass
class Phase:
    index: int
    name: str
    start: int  # first global step (optimizer steps before this phase)
    end: int  # global step at which the phase is complete
    config: RunConfig  # the run's config with this phase's overrides; config.train.steps = end - start

    @property
    def steps(self) -> int:
        return self.end - self.start


def resolve_phases(config: RunConfig, world: int = 1) -> list[Phase]:
    """The run's phases with global step ranges; `world` ranks share each global batch."""
    if not config.train.phases:
        single = copy.deepcopy(config)
        single.train.data_parallel = world
        return [Phase(0, "train", 0, config.train.steps, single)]
    phases, start = [], 0
    base = config.to_dict()
    base["train"]["phases"] = []
    for i, spec in enumerate(config.train.phases):
        tree = copy.deepcopy(base)
        for key, value in spec.overrides.items():
            set_dotted(tree, key, value)
        tree["train"]["data_parallel"] = world
        try:
            phase_config = build_run_config(tree)
        except ConfigError as exc:
            raise ConfigError(f"train.phases[{i}] ({spec.name or i}): {exc}") from None
        tokens_per_step = phase_config.train.global_batch * phase_config.data.seq_len
        steps = spec.steps if spec.steps is not None else math.ceil(spec.tokens / tokens_per_step)
        phase_config.train.steps = steps
        phases.append(Phase(i, spec.name or f"phase{i}", start, start + steps, phase_config))
        start += steps
    return phases


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The phase that global step `step` (0-based, the next one to run) belongs to."""
    for phase in phases:
        if step < phase.end:
            return phase
    return phases[-1]
