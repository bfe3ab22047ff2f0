"""lm-evaluation-harness on ropelab runs: every run on every task, with reports, and the harness's own
CLI with the model "ropelab" registered.

  evaluate_lm(runs, tasks, out) every run on every task -> results.json, results.md (a column per run,
                                a row per task/metric) and, with LAMBADA, lambada_ppl_vs_fraction.png
  cli_evaluate()                lm-eval's CLI with "ropelab" registered (``ropelab-lm-eval``)

The pieces: the harness model `ropelab.evaluate.lm_eval_model.RopelabLM` (its model_args:
`ropelab.evaluate.lm_eval_args`), the seed's task suite and task lookup `ropelab.evaluate.lm_eval_tasks`,
metrics and reports `ropelab.evaluate.lm_eval_report`.

How the harness finds "ropelab". lm-eval (0.4.x up to at least 0.4.13) resolves ``--model NAME`` only
through its in-process registry, filled by ``lm_eval.models`` and by whatever module the caller has
imported; it reads no entry points. Ways that work:

  * ``ropelab eval lm RUN ... --tasks paper --out DIR``  (uses this module directly);
  * ``python -m ropelab.evaluate.lm_eval run --model ropelab --model_args pretrained=RUN --tasks ...``
    or the console script ``ropelab-lm-eval ...``: lm-eval's own CLI, arguments unchanged, with this
    module imported first;
  * in Python: ``import ropelab.evaluate.lm_eval`` before ``lm_eval.simple_evaluate(model="ropelab", ...)``.

The package also declares ``[project.entry-points."lm_eval.models"] ropelab = ...``: lm-eval releases
with entry-point plugin discovery (lm-evaluation-harness PR #4013) then find it from the plain ``lm_eval``
CLI with nothing imported by hand.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

from ropelab import sources
from ropelab.config import ConfigError
from ropelab.evaluate.lm_eval_model import RopelabLM  # registers "ropelab" with the harness
from ropelab.evaluate.lm_eval_report import metric_value, run_labels, select_metrics, write_reports
from ropelab.evaluate.lm_eval_tasks import load_tasks, resolve_tasks


def evaluate_lm(
    runs: Sequence[str | Path],
    tasks: str | Sequence[str] = "paper",
    out_dir: str | Path = "eval",
    limit: Optional[float] = None,
    include_path: Optional[str | Path] = None,
    batch_size: int = 8,
    device: Optional[str] = None,
    max_length: Optional[int] = None,
    dtype: str = "float32",
    bootstrap_iters: int = 1000,
) -> dict:
    """Evaluate each run (run dir, checkpoint or imported folder) zero-shot on `tasks` ("paper" for the
    seed's suite, or names, harness or under `include_path`); write results.json, results.md and, with a
    LAMBADA task, lambada_ppl_vs_fraction.png into `out_dir`. Returns the results.json content."""
    import lm_eval
    from lm_eval import simple_evaluate

    if not runs:
        raise ConfigError("no run given")
    for run in runs:
        sources.resolve(run)  # ConfigError for a wrong path, before anything slow
    names = resolve_tasks(tasks)
    if limit is not None and limit <= 0:
        raise ConfigError(f"--limit {limit}: must be > 0")
    limit = int(limit) if limit is not None and float(limit).is_integer() else limit
    manager, _ = load_tasks(names, str(include_path) if include_path else None)

    labels = run_labels([str(r) for r in runs])
    entries = []
    for run, label in zip(runs, labels):
        started = time.time()
        lm = RopelabLM(pretrained=str(run), batch_size=batch_size, device=device, max_length=max_length, dtype=dtype)
        raw = simple_evaluate(
            model=lm, tasks=list(names), task_manager=manager, limit=limit, log_samples=False,
            bootstrap_iters=bootstrap_iters,
        )
        per_task = raw["results"]
        metrics = {}
        for task in per_task:
            chosen = select_metrics(task, per_task[task])
            metrics[task] = {m: metric_value(per_task[task], m) for m in chosen}
        entries.append({
            "label": label, "run": str(run), "checkpoint": lm.checkpoint,
            "effective_rope_fraction": lm.rope_fraction, "max_length": lm.max_length,
            "metrics": metrics,  # {task: {metric: [value, stderr]}}
            "lm_eval": {task: {k: v for k, v in per_task[task].items() if k != "alias"} for task in per_task},
            "n_samples": raw.get("n-samples", {}), "seconds": round(time.time() - started, 2),
        })
        del lm
    results = {
        "lm_eval_version": lm_eval.__version__, "tasks": list(dict.fromkeys(t for e in entries for t in e["metrics"])),
        "limit": limit, "runs": entries,
    }
    write_reports(results, out_dir)
    return results


def cli_evaluate() -> None:
    """``lm-eval`` with the "ropelab" model registered (`python -m ropelab.evaluate.lm_eval ...`)."""
    from lm_eval.__main__ import cli_evaluate as harness_cli

    harness_cli()


__all__ = ["evaluate_lm", "cli_evaluate"]

if __name__ == "__main__":
    cli_evaluate()
