"""Optional sections of a study report, present when the runs call for them:

  * convergence   whether each run's validation loss was still falling at the end (`ropelab.study.convergence`);
  * phases        validation loss after each phase of multi-phase runs (from result.json);
  * conversion    runs started from a source converted to a RoPE plan (`ropelab.study.conversion`);
  * long context  the study's long-context evaluation (``study_dir/longctx/``, written by
                  `evaluate_study_longctx` when the study YAML has a ``longctx`` key);
  * lm-eval       the study's zero-shot lm-eval tasks (`ropelab.study.lm_eval_step`);
  * extrapolation RoPE scaling methods beyond the trained length (`ropelab.study.extrapolation`);
  * memory        each model's cos/sin tables and key/value cache at 131,072 tokens (`ropelab.study.memory`);
  * frontier      a frontier study's table, cooldown check and scaling-law fits (`ropelab.study.frontier_report`).
Each section is markdown for report.md plus HTML and images for report.html.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from ropelab.config import ConfigError
from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.sources.runs import CONFIG, read_result, read_run_config
from ropelab.study.conversion import conversion_section
from ropelab.study.convergence import convergence_section
from ropelab.study.extrapolation import extrapolation_section
from ropelab.study.frontier_report import frontier_sections
from ropelab.study.lm_eval_step import lm_eval_section
from ropelab.study.memory import layer_kind_memory
from ropelab.study.section import LONGCTX_DIR, Section, folder_section, html_table, markdown_table

MEMORY_TOKENS = 131_072


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


def memory_section(study_dir: Path, seq_len: int = MEMORY_TOKENS) -> Section | None:
    """One row per model of the study (runs that differ only by seed share it): its layer pattern, the
    fp32 cos/sin tables and the bf16 key/value cache of one sequence of `seq_len` tokens (`layer_kind_memory`)."""
    names: dict[str, list[str]] = {}
    models = {}
    for run in sorted((study_dir / "runs").glob("*")):
        if not (run / CONFIG).is_file():
            continue
        try:
            model = read_run_config(run).model
        except ConfigError:  # a config of an older layout: the rest of the report still reads it, this row cannot
            continue
        models[repr(model)] = model
        names.setdefault(repr(model), []).append(re.sub(r"(^|-)seed\d+(?=-|$)", "", run.name) or run.name)
    if not models:
        return None
    header = ["runs", "layer pattern", "cos/sin tables (fp32)", "KV cache (bf16)"]
    rows = []
    for key, model in models.items():
        kinds = layer_kind_memory(model, seq_len, "bf16")
        rows.append([", ".join(dict.fromkeys(names[key])), model.layer_pattern or "—",
                     *(f"{sum(r[field] for r in kinds) / 2**20:,.2f} MiB" for field in ("rope_table_bytes", "kv_cache_bytes"))])
    note = (f"One sequence of {seq_len:,} tokens: a sliding or chunked layer keeps only its window's keys and values; "
            "layers with equal RoPE settings share one table.")
    return Section(f"RoPE tables and KV cache at {seq_len:,} tokens", f"{note}\n\n{markdown_table(header, rows)}",
                   f"<p>{html.escape(note)}</p>{html_table(header, rows)}")


def report_sections(study_dir: str | Path) -> list[Section]:
    study_dir = Path(study_dir)
    sections = (convergence_section(study_dir), phase_section(study_dir), conversion_section(study_dir),
                longctx_section(study_dir), lm_eval_section(study_dir), extrapolation_section(study_dir),
                memory_section(study_dir))
    return [s for s in sections if s is not None] + frontier_sections(study_dir)


def evaluate_study_longctx(study_dir: str | Path, options: dict, run_ids: list[str], progress: bool = True) -> dict | None:
    """Long-context evaluation of the study's finished runs into ``study_dir/longctx`` (once: an
    existing evaluation is kept; rerun `ropelab eval longctx` into another folder to redo it)."""
    study_dir = Path(study_dir)
    out = study_dir / LONGCTX_DIR
    if (out / "longctx.json").is_file() or not run_ids:
        return None
    return evaluate_longctx([study_dir / "runs" / r for r in run_ids], out, progress=progress, **options)
