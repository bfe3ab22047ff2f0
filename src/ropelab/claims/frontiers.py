"""A frontier study (`ropelab.study.frontier`) as the claims read it (`StudyFolder`): per model size,
each variant's final validation loss at every token budget, one value per seed; the claims' frontier
verdicts, the regime the verdict comes from, and the figure of loss and gap against tokens.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean
from typing import Mapping, Sequence

import numpy as np

from ropelab.claims.claim import Parts
from ropelab.claims.frontier_verdict import frontier_higher, frontier_matches
from ropelab.claims.groups import finish_axes
from ropelab.claims.study_folder import StudyFolder
from ropelab.config import ConfigError
from ropelab.study.convergence import tail_slopes
from ropelab.study.fit import fit_data_law
from ropelab.study.frontier import non_embedding_params
from ropelab.study.plots import new_figure, png_bytes

Frontiers = dict[str, dict[float, list[float]]]  # variant -> {tokens: [final loss per seed]}


def size_frontiers(study: StudyFolder, variants: Sequence[str] | None = None) -> dict[int, Frontiers]:
    """{non-embedding params: {variant: {tokens: [loss per seed, in seed order]}}} of the study's cooldowns."""
    points = study.frontier_points
    if not points:
        raise ConfigError(f"{study.path}: no finished frontier runs (a study with a `frontier` key writes them)")
    out: dict[int, Frontiers] = defaultdict(lambda: defaultdict(dict))
    for p in sorted(points, key=lambda p: (p["params"], p["variant"], p["tokens"], p["seed"])):
        out[p["params"]][p["variant"]].setdefault(p["tokens"], []).append(p["loss"])
    if variants is not None:
        for params, frontiers in out.items():
            missing = [v for v in variants if v not in frontiers]
            if missing:
                raise ConfigError(f"{study.path}: no frontier of variant {missing[0]!r} at {params:,} parameters")
        out = {params: {v: frontiers[v] for v in variants} for params, frontiers in out.items()}
    return {params: dict(frontiers) for params, frontiers in sorted(out.items())}


def regime(study: StudyFolder, largest_only: bool = False) -> str:
    """``2.5-20 tokens per non-embedding parameter (53k-160k parameters; up to 0.66 passes over the
    training data)``; with `largest_only`, the largest model at its largest budget: ``20 tokens per
    non-embedding parameter (160k parameters; ...)``. The passes are those of the runs' result.json
    (`ropelab.train.loop.data_passes`); runs trained before it was recorded leave them out."""
    points = study.frontier_points
    if largest_only:
        largest = max(p["params"] for p in points)
        points = [p for p in points if p["params"] == largest]
    ratios = [p["tokens"] / p["params"] for p in points]
    sizes = sorted({p["params"] for p in points})
    size_text = f"{sizes[0] / 1e3:.0f}k" + (f"-{sizes[-1] / 1e3:.0f}k" if len(sizes) > 1 else "")
    ratio_text = f"{max(ratios):.3g}" if largest_only else f"{min(ratios):.3g}-{max(ratios):.3g}"
    runs = {p["run"] for p in points}
    passes = [row["data_passes"] for row in study.rows if row["id"] in runs and row.get("data_passes") is not None]
    passes_text = f"; up to {max(passes):.2g} passes over the training data" if passes else ""
    return f"{ratio_text} tokens per non-embedding parameter ({size_text} parameters{passes_text})"


def runs_regime(study: StudyFolder) -> str:
    """The regime of a study without a frontier: tokens per non-embedding parameter its runs reached."""
    ratios = []
    for run in study.runs:
        if run.config and len(run.tokens):
            ratios.append(float(run.tokens[-1]) / non_embedding_params(study.config(run).model))
    if not ratios:
        return "no finished run"
    return f"{min(ratios):.3g}-{max(ratios):.3g} tokens per non-embedding parameter"


def still_falling_note(study: StudyFolder) -> str:
    """Which runs' validation loss was still falling at the end (`ropelab.study.convergence`)."""
    slopes = tail_slopes(study.path)
    if not slopes:
        return ""
    falling = [f"{run_id} ({s.slope:+.3f} per doubling)" for run_id, s in slopes.items() if s.still_falling]
    return (f"Still falling at the end: {', '.join(falling)}." if falling
            else f"No run's validation loss was still falling at the end ({len(slopes)} judged).")


def final_losses(frontiers: Frontiers) -> dict[str, list[float]]:
    """{variant: [loss per seed at its largest budget]}."""
    return {variant: frontier[max(frontier)] for variant, frontier in frontiers.items()}


def band_parts(frontiers: Frontiers, bands: Sequence[Sequence[str]], where: str, reference: str) -> Parts:
    """The seed's bands on frontiers, highest loss first: each band above every later one, and the
    last band's frontiers matching `reference` (full RoPE)."""
    parts: Parts = []
    for index, band in enumerate(bands[:-1]):
        below = [name for later in bands[index + 1:] for name in later]
        parts.append((f"{' and '.join(band)} above {', '.join(below)} ({where})",
                      frontier_higher({n: frontiers[n] for n in band}, {n: frontiers[n] for n in below})))
    others = [name for name in bands[-1] if name != reference]
    parts.append((f"{', '.join(others)} match {reference} ({where})",
                  frontier_matches({n: frontiers[n] for n in others}, {reference: frontiers[reference]})))
    return parts


def panel_name(key: int | str) -> str:
    """How frontiers keyed by a size (non-embedding parameters) or by a setting's name are labelled."""
    return f"{key:,} parameters" if isinstance(key, int) else key


def frontier_text(by_size: Mapping[int | str, Frontiers]) -> str:
    """Mean final loss per variant at the smallest and largest budget, per size (or named setting)."""
    parts = []
    for params, frontiers in by_size.items():
        budgets = sorted(next(iter(frontiers.values())))
        cells = "; ".join(f"{v} {fmean(f[budgets[0]]):.3f} -> {fmean(f[budgets[-1]]):.3f}" for v, f in frontiers.items())
        parts.append(f"{panel_name(params)}, {budgets[0]:.3g} -> {budgets[-1]:.3g} tokens: {cells}")
    return " | ".join(parts)


def plot_frontiers(by_size: Mapping[int | str, Frontiers], reference: str) -> bytes:
    """One panel per size (or named setting): each variant's final loss against tokens (seeds as points, the fitted
    L(D) = E + B D^-beta as a line where it has 3 budgets); a last panel: the gap of each variant to
    `reference` against tokens (mean over seeds), one line style per size."""
    fig = new_figure(4.0 * (len(by_size) + 1), 3.4)
    styles = ("-", "--", ":", "-.")
    gap_ax = fig.add_subplot(1, len(by_size) + 1, len(by_size) + 1)
    for index, (params, frontiers) in enumerate(by_size.items()):
        ax = fig.add_subplot(1, len(by_size) + 1, index + 1)
        for colour, (variant, frontier) in enumerate(frontiers.items()):
            tokens = [t for t in frontier for _ in frontier[t]]
            losses = [loss for t in frontier for loss in frontier[t]]
            ax.plot(tokens, losses, "o", ms=3, color=f"C{colour}", label=variant)
            if len(frontier) >= 3:
                law = fit_data_law(tokens, losses)
                grid = np.geomspace(min(tokens), max(tokens), 50)
                ax.plot(grid, law.predict(grid), "-", lw=1, color=f"C{colour}")
            if variant != reference and reference in frontiers:
                budgets = sorted(frontier)
                gap_ax.plot(budgets, [fmean(frontier[b]) - fmean(frontiers[reference][b]) for b in budgets],
                            styles[index % len(styles)], marker="o", ms=3, color=f"C{colour}",
                            label=f"{variant} ({params / 1e3:.0f}k)" if isinstance(params, int) else f"{variant} ({params})")
        ax.set_xscale("log")
        ax.set_title(f"{params:,} non-embedding parameters" if isinstance(params, int) else params, fontsize=9)
        finish_axes(ax, "tokens", "final validation loss")
    gap_ax.axhline(0, color="grey", lw=0.8)
    gap_ax.set_xscale("log")
    gap_ax.set_title(f"gap to {reference} (mean over seeds)", fontsize=9)
    finish_axes(gap_ax, "tokens", "loss difference")
    return png_bytes(fig)


__all__ = ["Frontiers", "size_frontiers", "regime", "runs_regime", "still_falling_note", "final_losses", "band_parts", "frontier_text", "plot_frontiers"]
