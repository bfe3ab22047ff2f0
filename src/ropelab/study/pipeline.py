"""A whole study: train (or continue) every run, evaluate the finished ones as the study asks, write
the report. `ropelab study` and `ropelab claims` both call `run_and_report`."""

from __future__ import annotations

from pathlib import Path

from ropelab.study.conversion_check import evaluate_study_conversion
from ropelab.study.extrapolation import evaluate_study_extrapolation
from ropelab.study.grid import StudyConfig
from ropelab.study.lm_eval_step import evaluate_study_lm_eval
from ropelab.study.report import write_report
from ropelab.study.runner import run_study
from ropelab.study.sections import evaluate_study_longctx


def run_and_report(study: StudyConfig, study_dir: str | Path, jobs: int = 1, live: bool = True) -> dict:
    """Returns {"statuses": {run id: status}, "report": {file name: path}}. Finished runs are skipped,
    so calling it again on the same folder only does what is left."""
    statuses = run_study(study, study_dir, jobs=jobs, live=live)
    done = [k for k, v in statuses.items() if v == "done"]
    evaluate_study_conversion(study_dir, done)  # runs recovered from a converted source: their distance to it
    if study.longctx is not None:
        evaluate_study_longctx(study_dir, study.longctx, done, live)
    if study.extrapolation is not None:
        evaluate_study_extrapolation(study_dir, study.extrapolation, done, live)
    if study.lm_eval is not None:
        evaluate_study_lm_eval(study_dir, study.lm_eval, done)
    return {"statuses": statuses, "report": write_report(study_dir)}
