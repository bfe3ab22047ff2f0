"""Reports of lm-evaluation-harness results: the metric chosen per task, the markdown table with a
column per run, and LAMBADA perplexity against RoPE fraction (the partial-RoPE seed's Figure 5).

Pure functions of the results dict that `ropelab.evaluate.lm_eval.evaluate_lm` builds; they need
neither the harness nor a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

PAPER_METRICS: dict[str, list[str]] = {
    "arc_easy": ["acc_norm"], "arc_challenge": ["acc_norm"], "logiqa": ["acc_norm"],
    "lambada_openai": ["acc", "perplexity"], "piqa": ["acc_norm"], "sciq": ["acc_norm"],
    "winogrande": ["acc"], "wsc273": ["acc"], "pubmedqa": ["acc"],
}
_PERPLEXITY_METRICS = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
_LOWER_IS_BETTER = set(_PERPLEXITY_METRICS)


def select_metrics(task: str, metrics: dict[str, Any]) -> list[str]:
    """The metrics reported for `task`: the seed's choice for its suite; otherwise acc_norm (else acc)
    plus any perplexity-style metric; otherwise every metric."""
    available = {key.split(",")[0] for key in metrics if "_stderr" not in key and key != "alias" and "," in key}
    if task in PAPER_METRICS:
        return [m for m in PAPER_METRICS[task] if m in available]
    chosen = ["acc_norm"] if "acc_norm" in available else ["acc"] if "acc" in available else []
    chosen += [m for m in _PERPLEXITY_METRICS if m in available]
    return chosen or sorted(available)


def metric_value(metrics: dict[str, Any], metric: str) -> tuple[Optional[float], Optional[float]]:
    def number(value):
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    for key, value in metrics.items():
        if key.split(",")[0] == metric:
            stderr = next((v for k, v in metrics.items() if k.split(",")[0] == f"{metric}_stderr"), None)
            return number(value), number(stderr)
    return None, None


def run_labels(paths: list[str]) -> list[str]:
    labels = []
    for raw in paths:
        p = Path(raw).resolve()
        label = f"{p.parent.parent.name}@{p.name}" if p.parent.name == "checkpoints" else p.name
        labels.append(label)
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[i] = f"{label}#{seen[label]}"
    return labels


def _format(metric: str, value: Optional[float], stderr: Optional[float]) -> str:
    if value is None:
        return "–"
    digits = 2 if metric in _LOWER_IS_BETTER and metric != "bits_per_byte" else 4
    show = lambda v: f"{v:.4g}" if abs(v) >= 1e6 else f"{v:.{digits}f}"  # noqa: E731
    text = show(value)
    if stderr is not None and math.isfinite(stderr):
        text += f" ± {show(stderr)}"
    return text


def results_markdown(results: dict) -> str:
    runs = results["runs"]
    header = "| task | metric | " + " | ".join(r["label"] for r in runs) + " |"
    lines = [header, "|" + "---|" * (len(runs) + 2)]
    for task in results["tasks"]:
        metrics: list[str] = []
        for run in runs:
            metrics += [m for m in run["metrics"].get(task, {}) if m not in metrics]
        for metric in metrics:
            cells = [_format(metric, *(r["metrics"].get(task, {}).get(metric) or (None, None))) for r in runs]
            arrow = "↓" if metric in _LOWER_IS_BETTER else "↑"
            lines.append(f"| {task} | {metric} {arrow} | " + " | ".join(cells) + " |")
    limit = results.get("limit")
    note = (f"lm-eval {results['lm_eval_version']}, zero-shot" + (f", limit {limit} per task" if limit else "")
            + "; runs: " + ", ".join(f"{r['label']} = {r['checkpoint']} (RoPE fraction {r['effective_rope_fraction']:.3g})" for r in runs))
    return "\n".join(lines) + "\n\n" + note + "\n"


def plot_lambada(results: dict, path: Path) -> Optional[Path]:
    """LAMBADA perplexity against each run's effective RoPE fraction (the seed's Figure 5)."""
    points = []
    for run in results["runs"]:
        for task, metrics in run["metrics"].items():
            if task.startswith("lambada") and metrics.get("perplexity") and metrics["perplexity"][0] is not None:
                points.append((run["effective_rope_fraction"], metrics["perplexity"][0], run["label"], task))
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for task in sorted({p[3] for p in points}):
        series = sorted(p for p in points if p[3] == task)
        ax.plot([p[0] for p in series], [p[1] for p in series], "o-", label=task)
        labels: dict[tuple[float, float], list[str]] = {}
        for x, y, label, _ in series:
            labels.setdefault((x, y), []).append(label)
        for (x, y), names in labels.items():  # runs on the same point share one label
            ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if all(p[1] > 0 for p in points) and max(p[1] for p in points) / min(p[1] for p in points) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("effective RoPE fraction (rotary dims / head dim)")
    ax.set_ylabel("LAMBADA perplexity ↓")
    ax.set_title("LAMBADA perplexity vs RoPE fraction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def write_reports(results: dict, out_dir: str | Path) -> dict[str, str]:
    """lambada_ppl_vs_fraction.png (with a LAMBADA task), results.md and results.json (which lists the
    files as results["files"]) in `out_dir`; returns {file name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"results.json": out / "results.json", "results.md": out / "results.md"}
    png = plot_lambada(results, out / "lambada_ppl_vs_fraction.png")
    if png is not None:
        files["lambada_ppl_vs_fraction.png"] = png
    results["files"] = {k: str(v) for k, v in files.items()}
    files["results.md"].write_text(results_markdown(results))
    files["results.json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results["files"]
