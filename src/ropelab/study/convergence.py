"""Has a run converged? For a run without a frontier, the slope of its validation loss per doubling of
tokens over the last quarter of its tokens (`ropelab.study.fit_checks.tail_slope`): a run whose loss still
falls by more than twice the slope's standard error is "still falling", and a verdict read from it
speaks of an unfinished curve.

  tail_slopes(study_dir)           {run id: TailSlope} for every run with three validation points or more
  convergence_section(study_dir)   the report's table of them (frontier runs are left to the frontier sections)
"""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError
from ropelab.study.fit_checks import TailSlope, tail_slope
from ropelab.study.frontier import read_frontier_record
from ropelab.study.section import Section, html_table, markdown_table
from ropelab.study.run_folders import collect_runs


def tail_slopes(study_dir: str | Path) -> dict[str, TailSlope]:
    slopes = {}
    for run in collect_runs(study_dir):
        steps, losses = run.val
        if len(steps) < 3:
            continue
        tokens = dict(zip(run.steps.tolist(), run.tokens.tolist()))
        try:
            slopes[run.id] = tail_slope([tokens.get(int(step), float(step)) for step in steps], losses)
        except ConfigError:  # fewer than three validation points in the last quarter, or none finite
            continue
    return slopes


def convergence_section(study_dir: str | Path) -> Section | None:
    """Each run's validation-loss slope per doubling of tokens over its last quarter; None for a
    frontier study (its cooldowns end in a decay, where the slope says nothing) or without slopes."""
    if read_frontier_record(study_dir):
        return None
    slopes = tail_slopes(study_dir)
    if not slopes:
        return None
    header = ["run", "slope per doubling of tokens (last quarter)", "standard error", "points", "still falling"]
    rows = [[run_id, f"{s.slope:+.4f}", f"{s.stderr:.4f}", str(s.n_points), "yes" if s.still_falling else "no"]
            for run_id, s in slopes.items()]
    falling = sum(s.still_falling for s in slopes.values())
    text = (f"{falling} of {len(slopes)} runs still falling at the end: their validation loss drops by more than twice "
            "the slope's standard error per doubling of tokens over the last quarter of the run. A comparison of "
            "final losses between such runs measures how far each got, not where each is heading (a `frontier` "
            "study answers that).")
    return Section("Convergence", f"{text}\n\n{markdown_table(header, rows)}", f"<p>{text}</p>{html_table(header, rows)}")


__all__ = ["tail_slopes", "convergence_section"]
