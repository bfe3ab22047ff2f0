"""Study configs: a base run config plus a grid, expanded into named runs.

A study YAML looks like::

    name: fractions
    base:                    # any `ropelab train` config keys, plus `preset`
      preset: tiny-llama
      train: {steps: 200}
    variants:                # optional: named override sets (one axis of the grid)
      - {name: nope, model.rope.fraction: 0}
      - {name: 2ch, model.rope.rotary_dims: 2}
    grid:                    # optional: dotted key -> list of values (cartesian product)
      seed: [0, 1]
      model.d_model,model.d_ff: [[32, 64], [64, 192]]   # keys joined by commas move together
    longctx: {lengths: [256, 1024]}   # optional: long-context evaluation of every finished run
    extrapolation: {lengths: [512, 1024]}   # optional: RoPE scaling methods beyond the trained length, every finished run
    lm_eval: {tasks: [lambada_wiki], include_path: configs/eval}   # optional: `ropelab eval lm`, every finished run
    teacher_cache: true      # optional: KD runs on the same batches share one teacher-targets cache
    frontier: {budgets: [5, 10, 20]}   # optional: each run becomes a trunk and a cooldown per budget (`ropelab.study.frontier`)
    engine: auto             # optional: auto (measured per group of runs, `ropelab.study.engine`) or eager

Run ids are readable and stable: the variant name, then ``<last key part><value>`` per grid
key, e.g. ``nope-seed1``.

A string value ``"@<run id>"`` refers to another run of the same study (e.g. a distillation
student's ``distill.teacher: "@teacher"``): the runner trains that run first and passes its
run directory in place of the reference.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from ropelab.config import ConfigError, RunConfig, build_run_config, from_dict, load_yaml, parse_override, set_dotted
from ropelab.errors import quoted
from ropelab.evaluate.extrapolation import make_settings
from ropelab.files import check_folder_name
from ropelab.sources.init import run_config
from ropelab.study.frontier import FrontierRun, frontier_runs, parse_frontier
from ropelab.study.lm_eval_step import check_lm_eval_options
from ropelab.train.phases import resolve_phases


@dataclass
class StudyConfig:
    name: str = "study"
    base: dict = field(default_factory=dict)
    variants: list = field(default_factory=list)
    grid: dict = field(default_factory=dict)
    target_loss: float | None = None
    longctx: dict | None = None  # `ropelab eval longctx` options: evaluate every finished run after training
    extrapolation: dict | None = None  # `ropelab eval extrapolation` options, likewise
    lm_eval: dict | None = None  # `ropelab eval lm` options (tasks, include_path, limit, ...), likewise
    teacher_cache: bool = False  # KD runs on the same batches share one teacher-targets cache (study.teacher_cache)
    frontier: dict | None = None  # each run as a trunk and cooldown branches per token budget (study.frontier)
    # how the runs are trained: auto (layout, compiled steps, allocator measured per group) or eager (`ropelab.study.engine`)
    engine: Literal["auto", "eager"] = "auto"


@dataclass
class PlannedRun:
    id: str
    overrides: dict[str, Any]
    config: RunConfig
    frontier: Optional[FrontierRun] = None  # in a frontier study: the trunk, a cooldown or a reference run


def _value_text(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9.+_]", "_", text)


def load_study(path: str | Path) -> StudyConfig:
    data = load_yaml(path)
    allowed = {"name", "base", "variants", "grid", "target_loss", "longctx", "extrapolation", "teacher_cache", "frontier", "engine",
               "lm_eval"}
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{path}: unknown study key {quoted(key)}; allowed: {', '.join(sorted(allowed))}")
    try:
        study = from_dict(StudyConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    extrapolation = data.get("extrapolation")
    if extrapolation is not None:  # checked now, not after training
        if not isinstance(extrapolation, dict):
            raise ConfigError(f"{path}: extrapolation: must map `ropelab eval extrapolation` options to values")
        try:
            make_settings(**extrapolation)
        except ConfigError as exc:
            raise ConfigError(f"{path}: extrapolation: {exc}") from None
    if data.get("lm_eval") is not None:
        try:
            check_lm_eval_options(data["lm_eval"])
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    if data.get("frontier") is not None:
        try:
            parse_frontier(data["frontier"])
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return study


def expand(study: StudyConfig) -> list[PlannedRun]:
    """Every run of the study, with its resolved (validated) config."""
    if not isinstance(study.grid, dict) or not isinstance(study.variants, list):
        raise ConfigError("study: `grid` must map keys to lists and `variants` must be a list")
    axes = [_grid_axis(key, values) for key, values in study.grid.items()]
    variants = study.variants or [{}]
    if not study.grid and not study.variants:
        raise ConfigError("study: empty grid (give `grid` and/or `variants`)")
    runs, seen = [], set()
    frontier = parse_frontier(study.frontier) if study.frontier is not None else None
    for index, variant in enumerate(variants):
        if not isinstance(variant, dict):
            raise ConfigError(f"variants: each entry must be a mapping, got {quoted(variant)}")
        if not all(isinstance(key, str) for key in variant):
            key = next(key for key in variant if not isinstance(key, str))
            raise ConfigError(f"variants[{index}].{quoted(key)}: a variant's keys are its name and dotted config "
                              "keys, e.g. model.rope.fraction")
        variant = dict(variant)
        name = str(variant.pop("name", "")) or "-".join(f"{k.split('.')[-1]}{_value_text(v)}" for k, v in variant.items())
        for points in itertools.product(*axes):
            settings = [pair for point in points for pair in point]  # (dotted key, value) of every grid axis
            overrides = {**variant, **dict(settings)}
            parts = [name] if name else []
            parts += [f"{k.split('.')[-1]}{_value_text(v)}" for k, v in settings]
            run_id = check_folder_name("-".join(parts) or "run", f"variants[{index}]: run id")
            tree = copy.deepcopy(study.base)
            for key, value in overrides.items():
                set_dotted(tree, key, value)
            config = _resolved(run_id, tree)
            planned = [(run_id, tree, None)]
            if frontier is not None:  # what a fit compares: the run without its seed and model shape
                compared = "-".join([name] * bool(name) + [f"{k.split('.')[-1]}{_value_text(v)}" for k, v in settings
                                                          if k != "seed" and not k.startswith("model.")]) or "run"
                planned = frontier_runs(run_id, compared, tree, config, frontier)
            for planned_id, planned_tree, record in planned:
                if planned_id in seen:
                    raise ConfigError(f"study: two runs would share the id {planned_id!r}; name the variants")
                seen.add(planned_id)
                planned_config = config if record is None else _resolved(planned_id, planned_tree)
                runs.append(PlannedRun(planned_id, overrides, planned_config, record))
    check_references(runs)
    return runs


def _grid_axis(key: Any, values: Any) -> list[list[tuple[str, Any]]]:
    """One grid axis as its points, each a list of (dotted key, value): a key ``a.b`` takes each value of
    its list; keys joined by commas (``model.d_model,model.d_ff``) move together, each value a list of
    one value per key (model shapes that are not a product of their sides)."""
    if not isinstance(key, str):
        raise ConfigError(f"grid.{quoted(key)}: a grid key is a dotted config key, e.g. model.rope.fraction")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"grid.{key}: must be a non-empty list of values")
    keys = [k.strip() for k in key.split(",")]
    if len(keys) == 1:
        return [[(key, value)] for value in values]
    for value in values:
        if not isinstance(value, list) or len(value) != len(keys):
            raise ConfigError(f"grid.{key}: each value must be a list of {len(keys)} values, one per key; "
                              f"got {quoted(value)}")
    return [list(zip(keys, value)) for value in values]


def _resolved(run_id: str, tree: dict) -> RunConfig:
    """The run's validated config; a source named ``"@<run id>"`` is a run of this study, not made yet."""
    try:
        train = tree.get("train") or {}
        referenced = any(isinstance(train.get(key), str) and train[key].startswith("@") for key in ("init_from", "branch_from"))
        # with train.init_from a source: its shape and tokenizer are the defaults
        config = build_run_config(tree) if referenced else run_config(tree)
        resolve_phases(config)  # phase overrides are checked now, not when the run starts
    except ConfigError as exc:
        raise ConfigError(f"run {run_id}: {exc}") from None
    return config


def references(config: RunConfig) -> list[tuple[str, str]]:
    """(dotted key, run id) for every ``"@<run id>"`` value in a run's config."""
    found = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{prefix}[{i}]")
        elif isinstance(node, str) and node.startswith("@"):
            found.append((prefix, node[1:]))

    walk(config.to_dict(), "")
    return found


def resolve_references(config: RunConfig, run_dirs: dict[str, str]) -> dict:
    """The run's config as a dict, each ``"@<run id>"`` replaced by that run's directory."""

    def sub(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: sub(value) for key, value in node.items()}
        if isinstance(node, list):
            return [sub(value) for value in node]
        if isinstance(node, str) and node.startswith("@") and node[1:] in run_dirs:
            return run_dirs[node[1:]]
        return node

    return sub(config.to_dict())


def check_references(runs: list[PlannedRun]) -> None:
    ids = {r.id for r in runs}
    for run in runs:
        for key, target in references(run.config):
            if target not in ids or target == run.id:
                raise ConfigError(f"run {run.id}: {key}='@{target}' must name another run of the study ({', '.join(sorted(ids))})")


def default_study() -> StudyConfig:
    """The partial-RoPE seed's fraction grid at CPU scale (the README's main command).

    NoPE, two channels, 10, 25, 50, 75 and 100% on `tiny-llama` (head_dim 64, so rotary_dims
    0, 2, 6, 16, 32, 48, 64) over the `stdlib` corpus, byte-level so that the 0.8M-parameter model
    learns visibly within the 15-minute CPU budget (about 0.8M tokens per run)."""
    fractions = [("nope", {"model.rope.fraction": 0.0}), ("2ch", {"model.rope.rotary_dims": 2})]
    fractions += [(f"rope{int(f * 100)}", {"model.rope.fraction": f}) for f in (0.1, 0.25, 0.5, 0.75, 1.0)]
    return StudyConfig(
        name="partial-rope-fractions (tiny)",
        base={
            "preset": "tiny-llama",
            "data": {"corpus": "stdlib", "tokenizer": "bytes", "seq_len": 256},
            "train": {"steps": 400, "micro_batch": 8, "lr": 2e-3, "eval_every": 50, "eval_batches": 8,
                      "checkpoint_every": 100, "precision": "fp32"},
        },
        variants=[{"name": name, **overrides} for name, overrides in fractions],
    )


def parse_cli_grid(items: list[str]) -> dict:
    """``--grid model.rope.fraction=[0,0.5,1]`` pairs into a grid mapping."""
    grid = {}
    for item in items:
        key, value = parse_override(item)
        grid[key] = value if isinstance(value, list) else [value]
    return grid
