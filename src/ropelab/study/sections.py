"""Optional sections of a study report, present when the runs call for them:

  * convergence   whether each run's validation loss was still falling at the end (`ropelab.study.convergence`);
  * phases        validation loss after each phase of multi-phase runs (from result.json);
  * conversion    runs started from a source converted to a RoPE plan (`ropelab.study.conversion`);
  * long context  the study's long-context evaluation (``study_dir/longctx/``, written by
                  `evaluate_study_longctx` when the study YAML has a ``longctx`` key);
  * extrapolation RoPE scaling methods beyond the trained length (`ropelab.study.extrapolation`);
  * frontier      a frontier study's table, cooldown check and scaling-law fits (`ropelab.study.frontier_report`).
Each section is markdown for report.md plus HTML and images for report.html.
"""

from __future__ import annotations

from pathlib import Path

from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.sources.runs import read_result
from ropelab.study.conversion import conversion_section
from ropelab.study.convergence import convergence_section
from ropelab.study.extrapolation import extrapolation_section
from ropelab.study.frontier_report import frontier_sections
from ropelab.study.section import Section, folder_section, html_table, markdown_table

LONGCTX_DIR = "longctx"


def _results(study_dir: Path) -> dict[str, dict]:
    out = {}
    for run in sorted((study_dir / "runs").glob("*")):
        result = read_result(run)
        if result is not None:
            out[run.name] = result
    return out


def phase_section(study_dir: Path) -> Section | None:
    """Validation loss at the end of every phase, one row per multi-phase run."""
    results = {run: r for run, r in _results(study_dir).items() if r.get("phases")}
    if not results:
        return None
    names = list(dict.fromkeys(p["name"] for r in results.values() for p in r["phases"]))
    header = ["run", *(f"val loss after {n}" for n in names)]
    rows = []
    for run, result in results.items():
        by_name = {p["name"]: p["val_loss"] for p in result["phases"]}
        rows.append([run, *(f"{by_name[n]:.4f}" if by_name.get(n) is not None else "—" for n in names)])
    return Section("Validation loss after each phase", markdown_table(header, rows), html_table(header, rows))


def longctx_section(study_dir: Path) -> Section | None:
    return folder_section("Long-context evaluation", study_dir, LONGCTX_DIR, "longctx.md",
                          ("longctx_heatmap.png", "loss_by_position.png"))


def report_sections(study_dir: str | Path) -> list[Section]:
    study_dir = Path(study_dir)
    sections = (convergence_section(study_dir), phase_section(study_dir), conversion_section(study_dir),
                longctx_section(study_dir), extrapolation_section(study_dir))
    return [s for s in sections if s is not None] + frontier_sections(study_dir)


def evaluate_study_longctx(study_dir: str | Path, options: dict, run_ids: list[str], progress: bool = True) -> dict | None:
    """Long-context evaluation of the study's finished runs into ``study_dir/longctx`` (once: an
    existing evaluation is kept; rerun `ropelab eval longctx` into another folder to redo it)."""
    study_dir = Path(study_dir)
    out = study_dir / LONGCTX_DIR
    if (out / "longctx.json").is_file() or not run_ids:
        return None
    return evaluate_longctx([study_dir / "runs" / r for r in run_ids], out, progress=progress, **options)
