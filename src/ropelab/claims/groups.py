"""Verdict groups: one value per seed for each variant of a study (`ropelab.claims.study_folder`),
picked and printed, and the axes of the claims' figures."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from ropelab.claims.study_folder import variant_of
from ropelab.config import ConfigError


def seed_groups(rows: Sequence[dict], metric: str = "final_val_loss", variants: Optional[Iterable[str]] = None) -> dict[str, list[float]]:
    """{variant: [metric per finished seed]} of the study summary's `rows`, for `variants` (default:
    every variant, in row order); a run that did not finish contributes NaN, so its group is
    inconclusive rather than silently smaller."""
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


def pick(groups: Mapping[str, list[float]], *names: str) -> dict[str, list[float]]:
    return {name: groups[name] for name in names}


def mean_text(groups: Mapping[str, Sequence[float]], spec: str = ".3f") -> str:
    """``nope 2.310 (2.300, 2.320); rope10 ...``: each group's mean and its seeds, formatted by `spec`
    (".3g" for values far from 1)."""
    return "; ".join(f"{name} {sum(values) / len(values):{spec}} ({', '.join(f'{v:{spec}}' for v in values)})"
                     for name, values in groups.items())


def finish_axes(ax, xlabel: str, ylabel: str, log_y: bool = False) -> None:
    """The claims' figures' axes: labels, a light grid, a small legend where lines have labels."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
