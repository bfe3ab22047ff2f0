"""The extrapolation part of a study (its YAML's ``extrapolation`` key, `ropelab eval extrapolation`
options): every finished run evaluated into ``study_dir/extrapolation/`` after training, and the report's
"Extrapolation" section (loss by position per method, the method x length tables)."""

from __future__ import annotations

from pathlib import Path

from ropelab.evaluate.extrapolation import evaluate_extrapolation
from ropelab.study.section import Section, folder_section

EXTRAPOLATION_DIR = "extrapolation"


def extrapolation_section(study_dir: Path) -> Section | None:
    return folder_section("Extrapolation", study_dir, EXTRAPOLATION_DIR, "extrapolation.md", ("loss_by_position.png",))


def evaluate_study_extrapolation(study_dir: str | Path, options: dict, run_ids: list[str], progress: bool = True) -> dict | None:
    """The study's finished runs into ``study_dir/extrapolation`` (once: an existing evaluation is kept;
    rerun `ropelab eval extrapolation` into another folder to redo it)."""
    study_dir = Path(study_dir)
    out = study_dir / EXTRAPOLATION_DIR
    if (out / "extrapolation.json").is_file() or not run_ids:
        return None
    return evaluate_extrapolation([study_dir / "runs" / r for r in run_ids], out, progress=progress, **options)
