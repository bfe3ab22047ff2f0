"""The lm-eval part of a study (its YAML's ``lm_eval`` key, `ropelab.evaluate.lm_eval.evaluate_lm` options:
``tasks``, ``include_path``, ``limit``, ``batch_size``, ``max_length``, ``dtype``): every finished run
evaluated zero-shot into ``study_dir/lm_eval/`` after training, and the report's "lm-eval" section (a
column per run, a row per task and metric)."""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError
from ropelab.errors import quoted
from ropelab.study.section import Section, folder_section

LM_EVAL_DIR = "lm_eval"
OPTIONS = ("tasks", "include_path", "limit", "batch_size", "max_length", "dtype")


def check_lm_eval_options(options) -> None:
    """One ConfigError line for a study's ``lm_eval`` value that `evaluate_lm` would refuse after training."""
    if not isinstance(options, dict):
        raise ConfigError("lm_eval: must map `ropelab eval lm` options to values (tasks, include_path, limit, ...)")
    for key in options:
        if key not in OPTIONS:
            raise ConfigError(f"lm_eval: unknown option {quoted(key)}; allowed: {', '.join(OPTIONS)}")
    include = options.get("include_path")
    if include is not None and not Path(include).is_dir():
        raise ConfigError(f"lm_eval.include_path: {include} is not a folder of task YAMLs")


def lm_eval_section(study_dir: Path) -> Section | None:
    return folder_section("lm-eval (zero-shot)", study_dir, LM_EVAL_DIR, "results.md", ("lambada_ppl_vs_fraction.png",))


def evaluate_study_lm_eval(study_dir: str | Path, options: dict, run_ids: list[str]) -> dict | None:
    """The study's finished runs on the tasks into ``study_dir/lm_eval`` (once: an existing evaluation is
    kept; rerun `ropelab eval lm` into another folder to redo it)."""
    from ropelab.evaluate.lm_eval import evaluate_lm  # the harness loads only for studies that ask for it

    study_dir = Path(study_dir)
    out = study_dir / LM_EVAL_DIR
    if (out / "results.json").is_file() or not run_ids:
        return None
    check_lm_eval_options(options)
    return evaluate_lm([study_dir / "runs" / r for r in run_ids], out_dir=out, **options)
