"""Reports of the extrapolation study: per run a method x length table, and loss by position per method.

Pure functions of the results dict built by `ropelab.evaluate.extrapolation.evaluate_extrapolation`; they
need no model. `write_reports` writes every file under a temporary name and renames it into place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ropelab.files import write_atomically
from ropelab.study.plots import new_figure, png_bytes

FILES = ("extrapolation.json", "extrapolation.md", "loss_by_position.png")

DEFINITION = ("Loss: mean next-token loss over the last half of each window, positions L/2+1..L (lower is "
              "better; at 2x the trained length these are exactly the positions beyond it). `none`: the model as "
              "trained; every other method replaces its scaling with factor L/T0 (or the fixed factor), T0 the "
              "base context. \"(= none)\": the same model as none (factor <= 1, or no layer rotates).")


def _cells(run: dict) -> dict[tuple[str, int], dict]:
    return {(c["method"], c["length"]): c for c in run["cells"]}


def _loss(cell: dict) -> str:
    return f"{cell['loss_last_half']:.3f}" + (" (= none)" if cell.get("same_as") else "")


def run_markdown(run: dict, settings: dict) -> list[str]:
    cells = _cells(run)
    lengths = list(dict.fromkeys(c["length"] for c in run["cells"]))
    methods = list(dict.fromkeys(c["method"] for c in run["cells"]))
    own = run["own_scaling"]
    trained = f"trained at {run['train_seq_len']} tokens" + (
        f" with {own['method']} x{own['factor']:g} from {own['original_max_position']}" if own else "")
    reference = run["loss_at_train_len"]
    refused = f" ({run.get('scaling_refused') or 'NoPE: every method is the model itself'})"
    lines = [f"## {run['label']}", "",
             f"{run['checkpoint']}: RoPE theta {run['rope_theta']:g}, {run['rotary_dims']}/{run['head_dim']} rotary dims"
             f"{'' if run['rotates'] else refused}, {trained}, base context "
             f"T0 = {run['base_context']}; {run['windows']} loss windows ({run['single_document_windows']} single-document); "
             f"{run['seconds']:.1f} s.", ""]
    if reference is not None:
        lines += [f"none over positions {run['train_seq_len'] // 2 + 1}–{run['train_seq_len']} (the trained length's "
                  f"last half): {reference:.3f}", ""]
    header = "| method | " + " | ".join(f"{n} ({n / run['base_context']:g} T0)" for n in lengths) + " |"
    lines += [header, "|" + "---|" * (len(lengths) + 1)]
    lines += [f"| {m} | " + " | ".join(_loss(cells[m, n]) for n in lengths) + " |" for m in methods]
    if settings["passkey"]:
        lines += ["", f"Passkey acc@1 / MRR (rank among {settings['distractors'] + 1} answers, "
                      f"{settings['items']} items x {len(settings['depths'])} depths per length):", "",
                  "| method | " + " | ".join(str(n) for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
        lines += [f"| {m} | " + " | ".join(f"{cells[m, n]['passkey']['acc_at_1']:.2f} / {cells[m, n]['passkey']['mrr']:.2f}"
                                            for n in lengths) + " |" for m in methods]
    return lines + [""]


def results_markdown(results: dict) -> str:
    lines = ["# Extrapolation", "", DEFINITION, ""]
    for run in results["runs"]:
        lines += run_markdown(run, results["settings"])
    return "\n".join(lines)


def plot_loss_by_position(results: dict) -> bytes:
    """A panel per run: bucketed loss against position at the longest length, a line per method; dashed:
    the trained length."""
    from matplotlib import colormaps

    runs = results["runs"]
    methods = list(dict.fromkeys(c["method"] for run in runs for c in run["cells"]))
    palette = colormaps["tab10"]
    columns = min(3, len(runs))
    rows = math.ceil(len(runs) / columns)
    fig = new_figure(4.6 * columns, 3.6 * rows)
    axes = fig.subplots(rows, columns, squeeze=False, gridspec_kw={"hspace": 0.45})
    for k, run in enumerate(runs):
        ax = axes[k // columns][k % columns]
        longest = max(c["length"] for c in run["cells"])
        for c in (c for c in run["cells"] if c["length"] == longest):
            x = [math.sqrt(b["start"] * (b["end"] - 1)) for b in c["buckets"]]  # geometric centre of the bucket
            style = ":" if c.get("same_as") else "o-"
            ax.plot(x, [b["loss"] for b in c["buckets"]], style, ms=3, color=palette(methods.index(c["method"]) % 10),
                    label=c["method"] + ("" if c["factor"] is None else f" x{c['factor']:g}"))
        ax.axvline(run["train_seq_len"], color="grey", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"{run['label']} ({run['rotary_dims']}/{run['head_dim']} rotary), {longest} tokens", fontsize=9)
        ax.set_xlabel("position", fontsize=8)
        ax.set_ylabel("mean next-token loss", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, frameon=False)
    for k in range(len(runs), rows * columns):
        axes[k // columns][k % columns].set_visible(False)
    return png_bytes(fig)


def write_reports(results: dict, out_dir: str | Path) -> dict[str, str]:
    """loss_by_position.png, extrapolation.md and extrapolation.json (listing the files as results["files"])."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contents = {"loss_by_position.png": plot_loss_by_position(results), "extrapolation.md": results_markdown(results).encode()}
    results["files"] = {name: str(out / name) for name in [*contents, "extrapolation.json"]}
    contents["extrapolation.json"] = (json.dumps(results, indent=2) + "\n").encode()
    for name, data in contents.items():
        write_atomically(out / name, data)
    return results["files"]
