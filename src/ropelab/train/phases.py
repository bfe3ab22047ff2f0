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
import re
from dataclasses import dataclass

from ropelab.config import ConfigError, RunConfig, build_run_config, set_dotted
from ropelab.config.position import POSITION_TYPES
from ropelab.rope import layer_frequencies
from ropelab.rope.bound import first_negative_of


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
        config.model.check_windows(config.data.seq_len)
        single = copy.deepcopy(config)
        single.train.data_parallel = world
        return [Phase(0, "train", 0, config.train.steps, single)]
    phases, start = [], 0
    base = config.to_dict()
    base["train"]["phases"] = []
    for i, spec in enumerate(config.train.phases):
        tree = copy.deepcopy(base)
        for key, value in spec.overrides.items():
            for spelled in override_keys(tree, key):
                set_dotted(tree, spelled, value)
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
    config.model.check_windows(max(phase.config.data.seq_len for phase in phases))
    return phases


def override_keys(tree: dict, key: str) -> list[str]:
    """Where a phase's override `key` is set in the run's config tree. A RoPE key (``model.rope.theta``,
    ``model.layer_kinds.G.rope.scaling.factor``) of layers whose RoPE keys come from a position list's
    rotation entry goes into that entry: `model.position`'s entry is laid over `model.rope` when the
    config is built (a theta it sets would undo the phase's), and a kind with a list has no `rope`."""
    match = re.fullmatch(r"model\.(?:layer_kinds\.([^.]+)\.)?rope\.(([^.]+).*)", key)
    if match is None:
        return [key]
    kind, rest, first = match.groups()
    owner = tree["model"] if kind is None else (tree["model"].get("layer_kinds") or {}).get(kind)
    entries = owner.get("position") if isinstance(owner, dict) else None
    rotation = next((i for i, entry in enumerate(entries or []) if isinstance(entry, dict) and
                     getattr(POSITION_TYPES.get(entry.get("type")), "channel", None) == "rotation"), None)
    if rotation is None or (kind is None and first not in entries[rotation]):
        return [key]  # model.rope as it is (a list without a rotation entry rotates nothing)
    spelled = f"model.{'' if kind is None else f'layer_kinds.{kind}.'}position[{rotation}].{rest}"
    return [key, spelled] if kind is None else [spelled]


def base_warnings(phases: list[Phase]) -> list[str]:
    """One line per phase whose RoPE frequencies, at its window length, fall short of Men et al.'s
    base bound (`ropelab.rope.bound`): some distance within the window where a key similar to the
    query gets less attention than a random one. Checked on each layer's own frequencies (its
    spectrum, plan and scaling at that length); NoPE layers have none."""
    lines = []
    for phase in phases:
        model, context = phase.config.model, phase.config.data.seq_len
        short = {}  # (theta, rotary dims) -> (first failing distance, layers)
        for layer in range(model.n_layer):
            rope = model.rope_for_layer(layer)
            if rope.resolve_dims(model.head_size) == 0 or (rope.select == "2-norm" and rope.pairs is None):
                continue  # no RoPE, or pairs that calibration chooses when the run starts
            dims = rope.resolve_dims(model.head_size)
            freqs = layer_frequencies(rope, model.head_size, model.kv_heads, context).reshape(-1, dims // 2)
            failing = [m for m in (first_negative_of(row.numpy(), context - 1) for row in freqs) if m is not None]
            if failing:
                key = (rope.theta, dims)
                short.setdefault(key, (min(failing), []))[1].append(layer)
        for (theta, dims), (distance, layers) in short.items():
            which = "every layer" if len(layers) == model.n_layer else f"layers {', '.join(map(str, layers))}"
            lines.append(f"warning: phase {phase.name!r}: RoPE theta {theta:g} on {dims} rotary dims ({which}) is below "
                         f"the base bound for {context:,}-token windows: a similar key loses to a random one from "
                         f"distance {distance:,} (Men et al. 2024; `ropelab rope-base --context {context} --dims {dims}`)")
    return lines


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The phase that global step `step` (0-based, the next one to run) belongs to."""
    for phase in phases:
        if step < phase.end:
            return phase
    return phases[-1]


def tokens_seen(phases: list[Phase], step: int) -> int:
    """Tokens trained on after global step `step` (phases may differ in batch and length)."""
    total = 0
    for phase in phases:
        done = min(max(step - phase.start, 0), phase.steps)
        total += done * phase.config.train.global_batch * phase.config.data.seq_len
    return total
