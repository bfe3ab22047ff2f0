"""Reports of the long-context evaluation: a markdown table (with the RULER section of
`ropelab.evaluate.ruler_report`), depth x length heatmaps of passkey and needle, loss by position.

Pure functions of the results dict built by `ropelab.evaluate.longctx.evaluate_longctx`; they need no
model. `write_reports` writes every file under a temporary name and renames it into place, and
`check_out_dir` refuses a folder that already holds long-context results, so nothing is overwritten.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.evaluate.ruler_report import ruler_markdown
from ropelab.evaluate.ruler_tasks import RULER_TASKS
from ropelab.files import write_atomically
from ropelab.study.plots import new_figure, png_bytes

FILES = ("longctx.json", "longctx.md", "longctx_heatmap.png", "loss_by_position.png")
METRICS = (("exact_match", "exact match"), ("mrr", "MRR"), ("acc_at_1", "acc@1"))
HEATMAP_METRICS = ("exact_match", "mrr")


def check_out_dir(out_dir: str | Path, files: tuple[str, ...] = FILES, kind: str = "long-context") -> None:
    """ConfigError unless `out_dir` is a folder (or nothing yet) holding none of `files`, the results of `kind`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder")
    taken = [name for name in files if (out / name).exists()]
    if taken:
        raise ConfigError(f"{out}: already holds {kind} results ({taken[0]}); choose a new --out (nothing is overwritten)")


# ------------------------------------------------------------------ table


def by_length(task_result: dict, metric: str) -> dict[int, float]:
    """Mean of `metric` over depths, per context length (cells hold equal numbers of items)."""
    values: dict[int, list[float]] = {}
    for cell in task_result["cells"]:
        values.setdefault(cell["length"], []).append(cell[metric])
    return {length: float(np.mean(v)) for length, v in values.items()}


def depth_tasks(settings: dict) -> list[str]:
    """The tasks measured over lengths x depths (passkey, needle), not RULER's."""
    return [task for task in settings["tasks"] if task not in RULER_TASKS]


def results_markdown(results: dict) -> str:
    runs = results["runs"]
    settings = results["settings"]
    header = "| task | metric | length | " + " | ".join(r["label"] for r in runs) + " |"
    lines = ["# Long-context evaluation"]
    if depth_tasks(settings):
        lines += ["", header, "|" + "---|" * (len(runs) + 3)]
    for task in depth_tasks(settings):
        for metric, name in METRICS:
            rows = [by_length(r["tasks"][task], metric) for r in runs]
            for length in settings["lengths"]:
                lines.append(f"| {task} | {name} ↑ | {length} | " + " | ".join(f"{row[length]:.2f}" for row in rows) + " |")
            lines.append(f"| {task} | {name} ↑ | all | " + " | ".join(f"{r['tasks'][task][metric]:.2f}" for r in runs) + " |")
    losses = [r.get("loss_by_position") for r in runs]
    if all(losses):
        lines += ["", "## Loss by position (mean next-token loss, log-spaced buckets)", "",
                  "| positions | " + " | ".join(r["label"] for r in runs) + " |", "|" + "---|" * (len(runs) + 1)]
        for j, bucket in enumerate(losses[0]["buckets"]):
            span = f"{bucket['start']}–{bucket['end'] - 1}"
            lines.append(f"| {span} | " + " | ".join(f"{loss['buckets'][j]['loss']:.3f}" for loss in losses) + " |")
        for key, name in (("loss_within_train_len", "≤ training length"), ("loss_beyond_train_len", "> training length")):
            cells = ["–" if loss[key] is None else f"{loss[key]:.3f}" for loss in losses]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    if depth_tasks(settings):
        lines.append(f"{settings['items']} items per (length, depth) cell, depths {', '.join(f'{d:g}' for d in settings['depths'])}; "
                     f"rank among {settings['distractors'] + 1} answers of {settings['digits']} digits; seed {settings['seed']}.")
    for r in runs:
        fingerprints = ", ".join(f"{t} {v['items_fingerprint']}" for t, v in r["tasks"].items())
        loss = r.get("loss_by_position")
        windows = f"; loss windows {loss['single_document_windows']}/{loss['windows']} single-document" if loss else ""
        lines.append(f"- {r['label']} = {r['checkpoint']}: RoPE theta {r['rope_theta']:g}, {r['rotary_dims']}/{r['head_dim']} "
                     f"rotary dims, trained at {r['train_seq_len']} tokens; items {fingerprints}{windows}; {r['seconds']:.1f} s")
    lines += ruler_markdown(results)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ figures


def plot_heatmaps(results: dict) -> Optional[bytes]:
    """A depth x length panel per run (rows) and passkey or needle task/metric (columns), values written
    in the cells; None without those tasks."""
    settings, runs = results["settings"], results["runs"]
    lengths, depths = settings["lengths"], settings["depths"]
    columns = [(task, metric) for task in depth_tasks(settings) for metric in HEATMAP_METRICS]
    if not columns:
        return None
    fig = new_figure(1.0 + 0.55 * len(lengths) * len(columns), 0.6 + (0.6 + 0.45 * len(depths)) * len(runs))
    axes = fig.subplots(len(runs), len(columns), squeeze=False, gridspec_kw={"hspace": 0.6})
    image = None
    for row, run in enumerate(runs):
        for col, (task, metric) in enumerate(columns):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for cell in run["tasks"][task]["cells"]:
                grid[depths.index(cell["depth"]), lengths.index(cell["length"])] = cell[metric]
            ax = axes[row][col]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for (i, j), value in np.ndenumerate(grid):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if value > 0.6 else "white")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6, rotation=45)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=6)
            ax.set_title(f"{run['label']}: {task} {dict(METRICS)[metric]}", fontsize=7)
            if col == 0:
                ax.set_ylabel("needle depth", fontsize=7)
            if row == len(runs) - 1:
                ax.set_xlabel("context length (tokens)", fontsize=7)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return png_bytes(fig)


def plot_loss_by_position(results: dict) -> Optional[bytes]:
    """Bucketed loss against position for every run on one log-x plot; dashed: each run's training length."""
    runs = [r for r in results["runs"] if r.get("loss_by_position")]
    if not runs:
        return None
    from matplotlib import colormaps

    fig = new_figure(7, 4.2)
    ax = fig.subplots()
    palette = colormaps["tab10"]
    for k, run in enumerate(runs):
        buckets = run["loss_by_position"]["buckets"]
        x = [math.sqrt(b["start"] * (b["end"] - 1)) for b in buckets]  # geometric centre of the bucket
        color = palette(k % 10)
        ax.plot(x, [b["loss"] for b in buckets], "o-", ms=3, color=color, label=run["label"])
        ax.axvline(run["train_seq_len"], color=color, ls="--", lw=1, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("position (tokens of context before the predicted token)")
    ax.set_ylabel("mean next-token loss")
    ax.set_title("loss by position (dashed: training sequence length)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, frameon=False)
    return png_bytes(fig)


# ------------------------------------------------------------------ files


def write_reports(results: dict, out_dir: str | Path) -> dict[str, str]:
    """The figures, longctx.md and longctx.json (listing the files as results["files"]); returns {name: path}."""
    out = Path(out_dir)
    check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    contents = {"longctx_heatmap.png": plot_heatmaps(results), "loss_by_position.png": plot_loss_by_position(results)}
    contents = {name: data for name, data in contents.items() if data is not None}
    contents["longctx.md"] = results_markdown(results).encode()
    results["files"] = {name: str(out / name) for name in [*contents, "longctx.json"]}
    contents["longctx.json"] = (json.dumps(results, indent=2) + "\n").encode()
    for name, data in contents.items():
        write_atomically(out / name, data)
    return results["files"]
