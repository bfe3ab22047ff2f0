"""The report section of a RoPE-conversion study: runs that start from a full-RoPE source converted to a
selected-pair plan (`train.init_from` with `model.rope.keep_pairs` / `select`), with or without recovery.

  conversion_rows(study_dir)   per run: plan, objective, loss and KL right after conversion, at the end
  conversion_section(...)      the table, loss and KL against tokens, and MHA2MLA's ordering beside ours

MHA2MLA (Ji et al. 2025, arXiv 2502.14837, Table 5): SmolLM-135M at r = 4 of 32 pairs, six-task
commonsense average after 2.25B tokens of fine-tuning.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from ropelab.sources.runs import read_result, read_run_config
from ropelab.study.plots import new_figure, png_bytes
from ropelab.study.section import Section, html_table, markdown_table
from ropelab.train.metrics import read_metrics

MHA2MLA_TABLE5 = {"full": 44.50, "2-norm": 43.77, "uniform": 43.76, "high": 43.40, "nope": 38.99, "low": 37.76}


def _objective(config) -> str:
    if config.distill is None:
        return "CE"
    return "KD" if config.distill.alpha > 0 else "CE (KL logged)"


def conversion_rows(study_dir: Path) -> list[dict]:
    """One row per finished run that started from `train.init_from`."""
    rows = []
    for run in sorted((Path(study_dir) / "runs").glob("*")):
        result = read_result(run)
        if result is None or not result.get("init_from"):
            continue
        config = read_run_config(run)
        conversion = result["init_from"].get("conversion") or {}
        metrics = read_metrics(run)
        val = [(r["tokens"], r["val_loss"]) for r in metrics if "val_loss" in r]
        kl = [(r["tokens"], r["kd"]) for r in metrics if "kd" in r]
        rows.append({
            "run": run.name, "select": conversion.get("select", "full"),
            "keep_pairs": conversion.get("keep_pairs", config.model.head_size // 2),
            "objective": _objective(config) if result["steps"] else "none",
            "tokens": result["tokens"], "steps": result["steps"],
            "loss_source": conversion.get("loss_source"),
            "loss_converted": conversion.get("loss_converted", val[0][1] if val else None),
            "kl_converted": conversion.get("kl_to_source", 0.0 if not conversion else None),
            "final_val_loss": val[-1][1] if val else None, "final_train_kl": kl[-1][1] if kl else None,
            "val_curve": val, "kl_curve": kl,
        })
    return rows


def _fmt(x: Optional[float], digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _curves(rows: list[dict]) -> bytes:
    fig = new_figure(10, 3.8)
    for index, (key, label) in enumerate((("val_curve", "validation loss"), ("kl_curve", "KL to source (training batches)"))):
        ax = fig.add_subplot(1, 2, index + 1)
        for row in rows:
            if len(row[key]) > 1:
                ax.plot([t for t, _ in row[key]], [v for _, v in row[key]], "o-", ms=3, label=row["run"])
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return png_bytes(fig)


def ordering(rows: list[dict]) -> list[list[str]]:
    """Per strategy (MHA2MLA's order, best first): their Table 5 average and our losses, right after
    conversion and after each recovery objective (lower is better)."""
    table = []
    for select, score in sorted(MHA2MLA_TABLE5.items(), key=lambda item: -item[1]):
        mine = [r for r in rows if r["select"] == select]
        after = {r["objective"]: r["final_val_loss"] for r in mine if r["steps"]}
        converted = next((r["loss_converted"] for r in mine), None)
        table.append([select, f"{score:.2f}", _fmt(converted), _fmt(after.get("KD")),
                      _fmt(after.get("CE", after.get("CE (KL logged)")))])
    return table


def conversion_section(study_dir: Path):
    """The section (markdown, HTML, the curves' image), or None when no run started from a source."""
    rows = conversion_rows(study_dir)
    if not rows:
        return None
    header = ["run", "plan", "objective", "tokens", "loss after conversion", "KL after conversion",
              "final val loss", "final KL (train)"]
    body = [[r["run"], f"{r['select']} r={r['keep_pairs']}", r["objective"], f"{r['tokens']:,}",
             _fmt(r["loss_converted"]), _fmt(r["kl_converted"]), _fmt(r["final_val_loss"]), _fmt(r["final_train_kl"])]
            for r in rows]
    order_header = ["strategy", "MHA2MLA avg (higher is better)", "our loss after conversion", "after KD", "after CE"]
    order = ordering(rows)
    source = next((r["loss_source"] for r in rows if r["loss_source"] is not None), None)
    intro = (f"Loss and KL on the runs' validation windows (nats/token); the source's loss there is {_fmt(source)}. "
             "MHA2MLA's ordering: their six-task average at r = 4 after 2.25B tokens (Table 5).")
    markdown = "\n".join([intro, "", "![conversion curves](conversion_curves.png)", "", markdown_table(header, body), "",
                          markdown_table(order_header, order)])
    html = (f"<p>{intro}</p><img src='conversion_curves.png'>" + html_table(header, body) + html_table(order_header, order))
    return Section("RoPE conversion and recovery", markdown, html, {"conversion_curves.png": _curves(rows)})

