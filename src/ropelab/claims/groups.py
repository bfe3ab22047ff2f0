"""Reading a finished study as verdict groups: one value per seed for each variant, and the
validation curves the claims' figures draw.

A run id is ``<variant>-seed<N>`` (the study grid's naming); the group of a run is its variant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from ropelab.config import ConfigError
from ropelab.study.plots import new_figure, png_bytes
from ropelab.study.summary import collect_runs, summarize

_SEED = re.compile(r"-seed\d+$")


def variant_of(run_id: str) -> str:
    return _SEED.sub("", run_id)


def study_rows(study_dir: Path) -> list[dict]:
    """The study summary's rows (final losses, spikes, seeds) of every run in `study_dir`."""
    if not (Path(study_dir) / "runs").is_dir():
        raise ConfigError(f"{study_dir}: no runs/ folder: the study has not run")
    return summarize(collect_runs(study_dir))


def seed_groups(rows: Sequence[dict], metric: str = "final_val_loss", variants: Optional[Iterable[str]] = None) -> dict[str, list[float]]:
    """{variant: [metric per finished seed]}, for `variants` (default: every variant, in row order);
    a run that did not finish contributes NaN, so its group is inconclusive rather than silently smaller."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        value = row.get(metric) if row["status"] == "done" else None
        groups.setdefault(variant_of(row["id"]), []).append(float("nan") if value is None else float(value))
    if variants is None:
        return groups
    missing = [v for v in variants if v not in groups]
    if missing:
        raise ConfigError(f"claims: the study has no run of variant {missing[0]!r}; it has {', '.join(groups)}")
    return {v: groups[v] for v in variants}


def schedule(study_dir: Path, run_id: str | None = None) -> str:
    """``200 steps x 8 x 256 tokens, lr 0.002, 2 seeds`` for a run of the study (default: the first),
    from its config.yaml."""
    runs = [run for run in collect_runs(study_dir) if run.config]
    if not runs:
        raise ConfigError(f"{study_dir}: no run with a readable config.yaml")
    run = next((r for r in runs if r.id == run_id), runs[0])
    train, data = run.config["train"], run.config["data"]
    seeds = len({r.config.get("seed") for r in runs if variant_of(r.id) == variant_of(run.id)})
    unit = "bytes" if data.get("tokenizer") == "bytes" else "tokens"
    return f"{train['steps']} steps x {train['micro_batch']} x {data['seq_len']} {unit}, lr {train['lr']:g}, {seeds} seeds"


def pick(groups: Mapping[str, list[float]], *names: str) -> dict[str, list[float]]:
    return {name: groups[name] for name in names}


def mean_text(groups: Mapping[str, Sequence[float]], spec: str = ".3f") -> str:
    """``nope 2.310 (2.300, 2.320); rope10 ...``: each group's mean and its seeds, formatted by `spec`
    (".3g" for values far from 1)."""
    return "; ".join(f"{name} {sum(values) / len(values):{spec}} ({', '.join(f'{v:{spec}}' for v in values)})"
                     for name, values in groups.items())


def plot_val_curves(panels: Mapping[str, Path], variants: Optional[Mapping[str, Sequence[str]]] = None) -> bytes:
    """Validation loss against tokens, one panel per study folder, one colour per variant (seeds
    share it). `variants` limits a panel to some variants."""
    fig = new_figure(4.4 * len(panels), 3.4)
    for index, (title, study_dir) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), index + 1)
        colours: dict[str, str] = {}
        for run in collect_runs(study_dir):
            variant = variant_of(run.id)
            if variants and variant not in variants.get(title, [variant]):
                continue
            steps, losses = run.val
            if not len(steps):
                continue
            tokens = dict(zip(run.steps.tolist(), run.tokens.tolist()))
            xs = [tokens.get(int(s), float(s)) for s in steps]
            colour = colours.setdefault(variant, f"C{len(colours) % 10}")
            label = variant if run.id.endswith("seed0") or "-seed" not in run.id else None
            ax.plot(xs, losses, "o-", ms=2.5, lw=1.2, color=colour, label=label)
        ax.set_title(title, fontsize=9)
        finish_axes(ax, "tokens", "validation loss")
    return png_bytes(fig)


def finish_axes(ax, xlabel: str, ylabel: str, log_y: bool = False) -> None:
    """The claims' figures' axes: labels, a light grid, a small legend where lines have labels."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
