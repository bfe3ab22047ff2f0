"""What a frontier study found: the frontier table, the scaling-law fits, and the cooldown method
measured against runs trained with the study's own schedule (`ropelab fit STUDY`, and sections of
every frontier study's report).

  frontier_sections(study_dir)   [the frontier table, the cooldown check, the fits], each a Section
  fit_sections(study_dir)        the same, or one line when there is nothing to fit (`ropelab fit`)
  write_fit(study_dir, out)      fit.md and its figures into `out` (a new or empty folder)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import fmean

from ropelab.config import ConfigError
from ropelab.files import refuse_existing, write_atomically
from ropelab.study.fit import Point
from ropelab.study.fit_report import fit_section
from ropelab.study.frontier import frontier_points, read_frontier_record
from ropelab.study.section import Section, html_table, markdown_table


def fit_points(points: list[dict]) -> list[Point]:
    """`frontier_points` rows as `ropelab.study.fit.Point`s."""
    return [Point(p["variant"], p["seed"], p["params"], p["tokens"], p["loss"]) for p in points]


def _mean_and_range(values: list[float]) -> str:
    return f"{fmean(values):.4f}" + (f" ± {(max(values) - min(values)) / 2:.4f}" if len(values) > 1 else "")


def _by_cell(points: list[dict], budget_key: str) -> dict[tuple, list[float]]:
    """{(variant, params, point[budget_key]): [loss per seed, in seed order]}."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for p in sorted(points, key=lambda p: (p["variant"], p["params"], p[budget_key], str(p["seed"]))):
        cells[(p["variant"], p["params"], p[budget_key])].append(p["loss"])
    return cells


def frontier_table(points: list[dict]) -> Section | None:
    """Final validation loss per variant and model size (rows) at every budget (columns) of the
    cooldowns' `points`: the mean over seeds ± half their range."""
    if not points:
        return None
    cells = _by_cell(points, "budget")
    budgets = sorted({p["budget"] for p in points})
    unit = "tokens/param" if points[0]["unit"] == "tokens_per_param" else "tokens"
    header = ["variant", "non-embedding params", *(f"{b:g} {unit}" for b in budgets)]
    rows = [[variant, f"{params:,}", *(_mean_and_range(cells[variant, params, b]) if cells.get((variant, params, b)) else "—"
                                       for b in budgets)]
            for variant, params in dict.fromkeys((v, n) for v, n, _ in cells)]
    text = ("Final validation loss of each cooldown branch (mean over seeds ± half their range), by tokens per "
            "non-embedding parameter (or tokens).")
    return Section("Frontier: final loss per budget", f"{text}\n\n{markdown_table(header, rows)}",
                   f"<p>{text}</p>{html_table(header, rows)}")


def cooldown_check(cooldown_points: list[dict], reference_points: list[dict]) -> Section | None:
    """The cooldown branch against the run trained to the same budget with the study's schedule, per
    variant, size and reference budget: the difference of the means against the seed-to-seed range."""
    cooldowns, references = _by_cell(cooldown_points, "tokens"), _by_cell(reference_points, "tokens")
    if not references:
        return None
    header = ["variant", "non-embedding params", "tokens", "cooldown branch", "study schedule", "difference",
              "largest seed range"]
    rows = []
    for key, reference in references.items():
        branch = cooldowns.get(key)
        if not branch:
            continue
        noise = max(max(v) - min(v) for v in (branch, reference))
        rows.append([key[0], f"{key[1]:,}", f"{key[2]:,}", _mean_and_range(branch), _mean_and_range(reference),
                     f"{fmean(branch) - fmean(reference):+.4f}", f"{noise:.4f}"])
    text = ("Hägele et al. 2024 (arXiv 2405.18392): a constant learning rate with a 20 % cooldown matches a cosine "
            "schedule at the same budget. Measured here: each cooldown branch against a run trained to the same "
            "budget with the study's own schedule (negative: the branch is lower).")
    return Section("Cooldown branches against the study's schedule", f"{text}\n\n{markdown_table(header, rows)}",
                   f"<p>{text}</p>{html_table(header, rows)}")


def frontier_sections(study_dir: str | Path) -> list[Section]:
    """The frontier study's sections; [] for a study without a frontier (or without finished cooldowns)."""
    study_dir = Path(study_dir)
    if not read_frontier_record(study_dir):
        return []
    points = frontier_points(study_dir)
    if not points:
        return []
    per_param = [p["budget"] for p in points if p["unit"] == "tokens_per_param"]
    largest = max(per_param, default=20.0)  # predictions at the largest budget trained, and at twice that
    budgets = {f"{largest:g} tokens/param": largest, f"{2 * largest:g} tokens/param": 2 * largest}
    sections = (frontier_table(points), cooldown_check(points, frontier_points(study_dir, roles=("reference",))),
                fit_section(fit_points(points), budgets))
    return [s for s in sections if s is not None]


def fit_sections(study_dir: str | Path) -> list[Section]:
    """`frontier_sections`, or a one-line ConfigError when there is nothing to fit (`ropelab fit`)."""
    sections = frontier_sections(study_dir)
    if not sections:
        raise ConfigError(f"{study_dir}: no finished frontier runs to fit (a study with a `frontier` key writes them)")
    return sections


def write_fit(study_dir: str | Path, out: str | Path) -> dict[str, Path]:
    """fit.md (the frontier table, the cooldown check and the fits) and its figures into `out`, a new
    or empty folder. Returns {file name: path}."""
    out = refuse_existing(out)
    sections = fit_sections(study_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for section in sections:
        for name, data in section.images.items():
            paths[name] = out / name
            paths[name].write_bytes(data)
    paths["fit.md"] = out / "fit.md"
    write_atomically(paths["fit.md"], "\n\n".join(f"## {s.title}\n\n{s.markdown}" for s in sections) + "\n")
    return paths


__all__ = ["fit_points", "frontier_table", "cooldown_check", "frontier_sections", "fit_sections", "write_fit"]
