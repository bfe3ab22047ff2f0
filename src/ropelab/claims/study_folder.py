"""The claims' one reader of a study folder. Each part is read on first use, once per `StudyFolder`,
by the study package's own readers:

  runs              every run folder (`ropelab.study.run_folders.collect_runs`: config.yaml,
                    metrics.jsonl, result.json, error.txt)
  rows              the study summary's row of each run (`ropelab.study.summary.summarize`)
  frontier          what each run of a frontier study is, from study.yaml (`ropelab.study.frontier`)
  frontier_points   the final loss of each finished cooldown of a frontier study

A run id is ``<variant>-seed<N>`` (the study grid's naming); the variant of a run is its group in a
verdict.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

from ropelab.config import ConfigError, RunConfig, build_run_config
from ropelab.study.frontier import FrontierRun, frontier_points, read_frontier_record
from ropelab.study.run_folders import Run, collect_runs
from ropelab.study.summary import summarize

SEED = re.compile(r"-seed(\d+)$")


def variant_of(run_id: str) -> str:
    return SEED.sub("", run_id)


class StudyFolder:
    """The study folder at `path` as the claims read it; nothing is read before it is asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @cached_property
    def runs(self) -> list[Run]:
        """Every run, sorted by id."""
        if not (self.path / "runs").is_dir():
            raise ConfigError(f"{self.path}: no runs/ folder: the study has not run")
        return collect_runs(self.path)

    @cached_property
    def rows(self) -> list[dict]:
        """The summary's rows (final losses, spikes, seeds), ordered by group, fraction and seed."""
        return summarize(self.runs)

    @cached_property
    def frontier(self) -> dict[str, FrontierRun]:
        """{run id: FrontierRun}; {} for a study without a frontier."""
        return read_frontier_record(self.path)

    @cached_property
    def frontier_points(self) -> list[dict]:
        """{run, role, variant, seed, params, budget, tokens, loss} of each finished cooldown."""
        return frontier_points(self.path, record=self.frontier)

    def seed_runs(self, variant: str) -> list[Run]:
        """The runs of `variant`, by seed."""
        runs = [run for run in self.runs if SEED.search(run.id) and variant_of(run.id) == variant]
        if not runs:
            raise ConfigError(f"claims: {self.path} has no run of variant {variant!r}")
        return sorted(runs, key=lambda run: int(SEED.search(run.id)[1]))

    @staticmethod
    def config(run: Run) -> RunConfig:
        """The run's config.yaml, checked as training checks it."""
        if not run.config:
            raise ConfigError(f"claims: {run.path}: {run.error or 'no config.yaml'}")
        return build_run_config(run.config)

    def schedule(self, run_id: str | None = None) -> str:
        """``200 steps x 8 x 256 tokens, lr 0.002, 2 seeds`` for a run of the study (default: the
        first), from its config.yaml."""
        runs = [run for run in self.runs if run.config]
        if not runs:
            raise ConfigError(f"{self.path}: no run with a readable config.yaml")
        run = next((r for r in runs if r.id == run_id), runs[0])
        train, data = run.config["train"], run.config["data"]
        seeds = len({r.config.get("seed") for r in runs if variant_of(r.id) == variant_of(run.id)})
        unit = "bytes" if data.get("tokenizer") == "bytes" else "tokens"
        return f"{train['steps']} steps x {train['micro_batch']} x {data['seq_len']} {unit}, lr {train['lr']:g}, {seeds} seeds"


__all__ = ["StudyFolder", "variant_of", "SEED"]
