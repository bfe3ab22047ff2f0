"""A study's run folders as read from disk, whatever state each run is in.

Layout read::

    study_dir/runs/<run_id>/config.yaml     resolved run config (see `ropelab.config.RunConfig`)
    study_dir/runs/<run_id>/metrics.jsonl   one row per logged step (`ropelab.train.loop`)
    study_dir/runs/<run_id>/result.json     present when the run finished
    study_dir/runs/<run_id>/error.txt       present when the run failed (its text is the error)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ropelab.config import ConfigError, read_yaml
from ropelab.sources.runs import read_result

__all__ = ["Run", "collect_runs", "read_metrics_tolerant"]


@dataclass
class Run:
    """One run directory as read from disk.

    status: ``done`` (result.json), ``failed`` (error.txt), ``incomplete`` (neither: still
    running or killed) or ``invalid`` (no readable config.yaml)."""

    id: str
    path: Path
    status: str
    config: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    result: Optional[dict] = None
    error: Optional[str] = None

    def _column(self, key: str, rows: list) -> np.ndarray:
        return np.array([float(r.get(key, math.nan)) if r.get(key) is not None else math.nan for r in rows])

    @property
    def train_rows(self) -> list:
        return [r for r in self.metrics if "loss" in r]

    @property
    def steps(self) -> np.ndarray:
        return np.array([int(r["step"]) for r in self.train_rows], dtype=np.int64)

    @property
    def losses(self) -> np.ndarray:
        return self._column("loss", self.train_rows)

    @property
    def tokens(self) -> np.ndarray:
        return self._column("tokens", self.train_rows)

    @property
    def val(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [r for r in self.metrics if r.get("val_loss") is not None]
        return np.array([int(r["step"]) for r in rows], dtype=np.int64), self._column("val_loss", rows)


def read_metrics_tolerant(path: Path) -> list[dict]:
    """metrics.jsonl rows, sorted by step; unreadable lines (a crash mid-write) are skipped and
    a step logged twice keeps its last row."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


def collect_runs(study_dir: str | Path) -> list[Run]:
    """Every run directory under ``study_dir/runs/``, sorted by name."""
    runs_dir = Path(study_dir) / "runs"
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"{runs_dir}: no runs folder; expected {Path(study_dir)}/runs/<run_id>/")
    runs = []
    for path in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        run = Run(id=path.name, path=path, status="incomplete")
        cfg_path = path / "config.yaml"
        try:
            run.config = (read_yaml(cfg_path) or {}) if cfg_path.is_file() else {}
            if not isinstance(run.config, dict):
                raise ConfigError(f"{cfg_path}: top level is not a mapping")
        except ConfigError as exc:
            run.config, run.status, run.error = {}, "invalid", str(exc)
        run.metrics = read_metrics_tolerant(path / "metrics.jsonl")
        run.result = read_result(path)
        error_path = path / "error.txt"
        # a result.json outweighs an error.txt: another attempt (a concurrent run, a re-run) finished the run
        if error_path.is_file() and run.result is None:
            run.status = "failed"
            run.error = error_path.read_text(errors="replace").strip() or "error.txt (empty)"
        elif run.status != "invalid":
            if not cfg_path.is_file():
                run.status, run.error = "invalid", "no config.yaml"
            elif run.result is not None:
                run.status = "done"
        runs.append(run)
    return runs
