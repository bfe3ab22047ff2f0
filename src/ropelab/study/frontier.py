"""Loss frontiers: a final loss at every token budget for about the cost of the longest run.

A study with a ``frontier`` key trains each of its runs once as a *trunk* (warm-up, then a constant
learning rate), keeps a checkpoint at the start of each budget's cooldown, and branches a cooldown
from each (`train.branch_from`): the last `cooldown` of the budget's steps, the learning rate decaying
by `shape` to `lr * min_lr_ratio`. Hägele et al. 2024 (arXiv 2405.18392) show that a 20 % (1-sqrt)
cooldown matches a cosine schedule trained to the same budget; `reference` budgets are also trained
as ordinary runs with the study's own schedule, so the study measures that claim where it runs::

    frontier:
      budgets: [2.5, 5, 10, 20]     # tokens per non-embedding parameter (unit: tokens_per_param)
      unit: tokens_per_param        # or tokens
      cooldown: 0.2                 # share of each budget's steps spent decaying
      shape: 1-sqrt                 # or linear
      reference: [5, 20]            # optional: these budgets also trained with the base schedule
      reference_variants: [rope100] # optional: only for these variants (default: every one)

Run ids: ``<run>-trunk``, ``<run>-<budget>`` for each cooldown (``rope10-seed0-20tpp``) and
``<run>-<budget>-ref`` for each reference run. Every run is an ordinary run directory; the study
records what each one is (`FrontierRun`) in study.yaml, and `frontier_points` reads the final losses.
With budgets b and cooldown c the trunk trains (1 - c) * max(b) and the cooldowns c * sum(b):
budgets doubling from b to 8b cost 1.18x the longest run alone.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from ropelab.config import ConfigError, ModelConfig, RunConfig, from_dict, read_yaml, set_dotted
from ropelab.errors import quoted
from ropelab.sources.runs import read_result

UNIT_SUFFIX = {"tokens_per_param": "tpp", "tokens": "tok"}


@dataclass
class FrontierConfig:
    budgets: list[float] = field(default_factory=list)
    unit: Literal["tokens_per_param", "tokens"] = "tokens_per_param"
    cooldown: float = 0.2
    shape: Literal["1-sqrt", "linear"] = "1-sqrt"
    reference: list[float] = field(default_factory=list)
    reference_variants: Optional[list[str]] = None

    def validate(self) -> "FrontierConfig":
        if len(self.budgets) < 1 or any(not (math.isfinite(b) and b > 0) for b in self.budgets):
            raise ConfigError(f"frontier.budgets={self.budgets}: give one or more positive budgets")
        if len(set(self.budgets)) != len(self.budgets):
            raise ConfigError(f"frontier.budgets={self.budgets}: budgets must be distinct")
        if not 0 < self.cooldown < 1:
            raise ConfigError(f"frontier.cooldown={self.cooldown}: must be in (0, 1)")
        unknown = sorted(set(self.reference) - set(self.budgets))
        if unknown:
            raise ConfigError(f"frontier.reference: {unknown} are not among frontier.budgets {self.budgets}")
        return self


@dataclass(frozen=True)
class FrontierRun:
    """What a run of a frontier study is: the trunk of `group`, or its cooldown (or reference run) at
    `budget` (in the frontier's unit; `tokens` in tokens)."""

    role: Literal["trunk", "cooldown", "reference"]
    group: str  # the run the frontier belongs to (variant and grid values, seed included)
    variant: str  # the group without its seed and model-shape values: what a fit compares
    seed: int
    params: int  # non-embedding parameters
    budget: Optional[float] = None
    tokens: Optional[int] = None
    unit: str = "tokens_per_param"  # the budget's


def parse_frontier(data) -> FrontierConfig:
    if not isinstance(data, dict):
        raise ConfigError("frontier: must map frontier keys (budgets, unit, cooldown, shape, reference) to values")
    return from_dict(FrontierConfig, data, "frontier").validate()


_PARAMS: dict[str, int] = {}  # non-embedding parameters per model shape: a study asks for the same few shapes often


def non_embedding_params(model: ModelConfig) -> int:
    """Parameters of the model without its token embedding and head (the N of scaling laws)."""
    import torch

    from ropelab.model import Transformer
    from ropelab.sources.plans import shape_config

    shape = dataclasses.replace(shape_config(model), vocab_size=model.vocab_size or 4096)
    key = repr(shape)
    if key not in _PARAMS:
        with torch.device("meta"):
            _PARAMS[key] = Transformer(shape).num_params(non_embedding=True)
    return _PARAMS[key]


def budget_label(budget: float, unit: str) -> str:
    return f"{budget:g}{UNIT_SUFFIX[unit]}"


def _steps(budget: float, frontier: FrontierConfig, params: int, tokens_per_step: int) -> int:
    tokens = budget * params if frontier.unit == "tokens_per_param" else budget
    return max(1, round(tokens / tokens_per_step))


def frontier_runs(run_id: str, variant: str, tree: dict, config: RunConfig,
                  frontier: FrontierConfig) -> list[tuple[str, dict, FrontierRun]]:
    """(run id, config tree, what it is) for the trunk, the cooldowns and the reference runs that
    stand in for one planned run `run_id` (its config `tree`, resolved as `config`)."""
    if config.train.phases:
        raise ConfigError(f"run {run_id}: a frontier needs single-phase runs (train.phases is set)")
    params = non_embedding_params(config.model)
    tokens_per_step = config.train.global_batch * config.data.seq_len
    steps = {b: _steps(b, frontier, params, tokens_per_step) for b in sorted(frontier.budgets)}
    cooldown = {b: max(1, round(frontier.cooldown * s)) for b, s in steps.items()}
    starts = {b: steps[b] - cooldown[b] for b in steps}
    # the trunk is the longest run: it warms up as a run of the largest budget would
    warmup = round(config.train.warmup_fraction * steps[max(steps)]) if config.train.warmup_steps is None \
        else config.train.warmup_steps
    for budget, start in starts.items():
        if start <= warmup:
            raise ConfigError(f"run {run_id}: frontier budget {budget_label(budget, frontier.unit)} is {steps[budget]} "
                              f"steps; its cooldown would start at step {start}, within the warm-up ({warmup} steps)")
    what = dict(group=run_id, variant=variant, seed=config.seed, params=params, unit=frontier.unit)

    def planned(suffix: str, values: dict, role: str, budget: Optional[float] = None):
        planned_tree = copy.deepcopy(tree)
        for key, value in {"train.warmup_steps": warmup, **values}.items():
            set_dotted(planned_tree, key, value)
        record = FrontierRun(role, budget=budget, tokens=None if budget is None else steps[budget] * tokens_per_step,
                             **what)
        return f"{run_id}-{suffix}", planned_tree, record

    trunk_id = f"{run_id}-trunk"
    runs = [planned("trunk", {"train.steps": max(starts.values()), "train.schedule": "constant",
                              "train.checkpoint_steps": sorted(set(starts.values()))}, "trunk")]
    for budget in steps:
        label = budget_label(budget, frontier.unit)
        runs.append(planned(label, {"train.steps": steps[budget], "train.schedule": "wsd",
                                    "train.decay_fraction": cooldown[budget] / steps[budget],
                                    "train.decay_shape": frontier.shape, "train.init_from": None,
                                    "train.branch_from": f"@{trunk_id}", "train.branch_step": starts[budget]},
                            "cooldown", budget))
    if frontier.reference_variants is None or variant in frontier.reference_variants:
        for budget in sorted(frontier.reference):
            runs.append(planned(f"{budget_label(budget, frontier.unit)}-ref",
                                {"train.steps": steps[budget], "train.warmup_steps": config.train.warmup_steps},
                                "reference", budget))
    return runs


def read_study_record(study_dir: Path) -> dict:
    """The study's study.yaml ({} for a folder without one): its `name`, `runs` mapping run ids to their
    configs and, in a frontier study, `frontier` mapping run ids to `FrontierRun` fields; a one-line
    ConfigError naming the file and key when it is not."""
    path = Path(study_dir) / "study.yaml"
    if not path.is_file():
        return {}
    record = read_yaml(path)
    if record is None:
        return {}
    damaged = f"{path}: the study record is damaged:"
    if not isinstance(record, dict):
        raise ConfigError(f"{damaged} expected a mapping of name, runs and frontier, got {quoted(record)}")
    if isinstance(record.get("name"), (dict, list)):
        raise ConfigError(f"{damaged} name={quoted(record['name'])}: must be the study's name (a string)")
    for key in ("runs", "frontier"):
        entries = record.get(key, {})
        if not isinstance(entries, dict):
            raise ConfigError(f"{damaged} {key}={quoted(entries)}: must map run ids to mappings")
        for run_id, entry in entries.items():
            if not isinstance(run_id, str) or not isinstance(entry, dict):
                raise ConfigError(f"{damaged} {key}.{quoted(run_id)}: must map a run id (a string) to a mapping, "
                                  f"got {quoted(entry)}")
            if key == "frontier":
                _frontier_run(entry, f"{path}: frontier.{run_id}")
    return record


def _frontier_run(entry: dict, key: str) -> FrontierRun:
    missing = [f.name for f in dataclasses.fields(FrontierRun) if f.default is dataclasses.MISSING and f.name not in entry]
    if missing:
        raise ConfigError(f"{key}: no {missing[0]!r}; the study record is damaged")
    return from_dict(FrontierRun, entry, key)


def read_frontier_record(study_dir: Path) -> dict[str, FrontierRun]:
    """{run id: FrontierRun} from the study's study.yaml ({} for a study without a frontier, or a folder
    without study.yaml)."""
    path = Path(study_dir) / "study.yaml"
    return {run_id: _frontier_run(entry, f"{path}: frontier.{run_id}")
            for run_id, entry in read_study_record(study_dir).get("frontier", {}).items()}


def frontier_points(study_dir: Path, roles: tuple[str, ...] = ("cooldown",),
                    record: Optional[dict[str, FrontierRun]] = None) -> list[dict]:
    """One point per finished run of the given roles: {run, role, variant, seed, params, budget,
    tokens, loss (its final validation loss)}. `record`: the study's frontier record where the
    caller has read it already (`read_frontier_record`)."""
    points = []
    record = read_frontier_record(study_dir) if record is None else record
    for run_id, run in record.items():
        if run.role not in roles:
            continue
        result = read_result(Path(study_dir) / "runs" / run_id)
        if result is None or result.get("final_val_loss") is None:
            continue
        points.append({"run": run_id, **dataclasses.asdict(run), "loss": float(result["final_val_loss"])})
    return points


__all__ = ["FrontierConfig", "FrontierRun", "parse_frontier", "frontier_runs", "non_embedding_params",
           "read_study_record", "read_frontier_record", "frontier_points", "budget_label"]
