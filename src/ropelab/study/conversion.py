"""The report section of a RoPE-conversion study: runs that start from a full-RoPE source converted to a
selected-pair plan (`train.init_from` with `model.rope.keep_pairs` / `select`), optionally to multi-head
latent attention (`model.mla`), with or without recovery.

  conversion_rows(study_dir)   per run: plan, latent rank, cache per token and layer, objective, loss and KL
                               right after conversion and at the end (`ropelab.study.conversion_check`),
                               and the study's long-context and lm-eval scores of the run where it has them
  conversion_section(...)      that table, loss and KL against tokens, and MHA2MLA's figures beside ours

MHA2MLA (Ji et al. 2025, arXiv 2502.14837, version 1) on SmolLM-135M (3 KV heads of 64 channels), after
2.25B tokens of fine-tuning, six-task commonsense average (MMLU, ARC, PIQA, HellaSwag, OBQA, Winogrande):
Table 5, partial RoPE alone at r = 4 of 32 pairs, per selection; Table 1, with the joint-SVD latent of
rank d_kv per KV head beside the 4 pairs (the KV cut there counts 3 x (8 + d_kv) of 384 values).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ropelab.sources.runs import read_result, read_run_config
from ropelab.study.conversion_check import read_held_out
from ropelab.study.lm_eval_step import LM_EVAL_DIR
from ropelab.study.memory import kv_cache_bytes
from ropelab.study.plots import new_figure, png_bytes
from ropelab.study.section import LONGCTX_DIR, Section, html_table, markdown_table
from ropelab.train.metrics import read_metrics

MHA2MLA_TABLE5 = {"full": 44.50, "2-norm": 43.77, "uniform": 43.76, "high": 43.40, "nope": 38.99, "low": 37.76}
# d_kv: (their KV cache cut, six-task average); the source scores 44.50
MHA2MLA_TABLE1 = {32: (-0.6875, 43.06), 16: (-0.8125, 41.84), 8: (-0.8750, 40.97)}
LONGCTX_RESULTS = (LONGCTX_DIR, "longctx.json")
LM_EVAL_RESULTS = (LM_EVAL_DIR, "results.json")


def _objective(config) -> str:
    if config.distill is None:
        return "CE"
    return "KD" if config.distill.alpha > 0 else "CE (KL logged)"


def _cache_per_token_layer(model) -> tuple[float, float]:
    """(values a token leaves in the cache per layer, averaged over the layers; the share of the
    full keys and values it saves: K x 2D per layer)."""
    values = sum(kv_cache_bytes(model, layer, 1, "fp32") // 4 for layer in range(model.n_layer)) / model.n_layer
    return values, 1 - values / (model.kv_heads * 2 * model.head_size)


def _runs_of(study_dir: Path, parts: tuple[str, str]) -> dict[str, dict]:
    """A study evaluation's entries by run name (`label`), or {} where it is missing or unreadable: the
    report shows what there is, the evaluation's own section says what went wrong."""
    try:
        entries = json.loads((study_dir.joinpath(*parts)).read_text())["runs"]
        return {entry["label"]: entry for entry in entries if isinstance(entry, dict) and "label" in entry}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _scores(longctx: Optional[dict], lm_eval: Optional[dict]) -> dict[str, str]:
    """Column name -> value: per long-context task its acc@1 with the MRR, per lm-eval task its acc and
    perplexity (what the task reports of the two)."""
    out = {}
    for task, entry in ((longctx or {}).get("tasks") or {}).items():
        if isinstance(entry, dict) and "acc_at_1" in entry:
            out[f"{task} acc@1 (MRR)"] = f"{entry['acc_at_1']:.2f} ({entry.get('mrr', float('nan')):.2f})"
    for task, metrics in ((lm_eval or {}).get("metrics") or {}).items():
        for metric, short, spec in (("acc", "acc", ".3f"), ("perplexity", "ppl", ".4g")):
            value = (metrics or {}).get(metric)
            if isinstance(value, list) and value:
                out[f"{task} {short}"] = format(value[0], spec)
    return out


def conversion_rows(study_dir: Path) -> list[dict]:
    """One row per finished run that started from `train.init_from`."""
    study_dir = Path(study_dir)
    longctx, lm_eval = _runs_of(study_dir, LONGCTX_RESULTS), _runs_of(study_dir, LM_EVAL_RESULTS)
    held_out = read_held_out(study_dir)
    rows = []
    for run in sorted((study_dir / "runs").glob("*")):
        result = read_result(run)
        if result is None or not result.get("init_from"):
            continue
        config = read_run_config(run)
        conversion = result["init_from"].get("conversion") or {}
        metrics = read_metrics(run)
        val = [(r["tokens"], r["val_loss"]) for r in metrics if "val_loss" in r]
        kl = [(r["tokens"], r["kd"]) for r in metrics if "kd" in r]
        cache_values, cache_saved = _cache_per_token_layer(config.model)
        rows.append({
            "run": run.name, "select": conversion.get("select", "full"),
            "keep_pairs": conversion.get("keep_pairs", config.model.head_size // 2),
            "rank": config.model.mla.rank if config.model.mla is not None else None,
            "cache_values": cache_values, "cache_saved": cache_saved,
            "objective": _objective(config) if result["steps"] else "none",
            "tokens": result["tokens"], "steps": result["steps"],
            "loss_source": conversion.get("loss_source"),
            "loss_converted": conversion.get("loss_converted", val[0][1] if val else None),
            "kl_converted": conversion.get("kl_to_source", 0.0 if not conversion else None),
            "final_val_loss": val[-1][1] if val else None, "final_train_kl": kl[-1][1] if kl else None,
            "final_kl": (held_out.get(run.name, {}) if result["steps"] else conversion).get("kl_to_source"),
            "val_curve": val, "kl_curve": kl, "scores": _scores(longctx.get(run.name), lm_eval.get(run.name)),
        })
    # the source, the conversions without and with a latent (larger ranks last), then their recoveries
    return sorted(rows, key=lambda r: (r["select"] != "full", r["rank"] is not None, r["steps"] > 0, r["rank"] or 0,
                                       r["objective"] != "KD", r["run"]))


def _fmt(x: Optional[float], digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _cache(row: dict) -> str:
    """``36 values, 72 B (-90.6%)``: per token and layer, bytes in bf16."""
    values = row["cache_values"]
    shown = f"{values:g} values, {2 * values:g} B"
    return shown if row["cache_saved"] <= 0 else f"{shown} ({-100 * row['cache_saved']:.1f}%)"


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


def _after(rows: list[dict]) -> tuple[Optional[float], dict[str, Optional[float]]]:
    """Of runs of one plan: the loss right after conversion, and the final validation loss per objective."""
    after = {r["objective"]: r["final_val_loss"] for r in rows if r["steps"]}
    converted = next((r["loss_converted"] for r in rows), None)
    return converted, {"KD": after.get("KD"), "CE": after.get("CE", after.get("CE (KL logged)"))}


def ordering(rows: list[dict]) -> list[list[str]]:
    """Per strategy (MHA2MLA's order, best first): their Table 5 average and our losses of the runs that
    change RoPE alone (no latent), right after conversion and after each recovery objective (lower is better)."""
    table = []
    for select, score in sorted(MHA2MLA_TABLE5.items(), key=lambda item: -item[1]):
        converted, after = _after([r for r in rows if r["select"] == select and r["rank"] is None])
        table.append([select, f"{score:.2f}", _fmt(converted), _fmt(after["KD"]), _fmt(after["CE"])])
    return table


def latent_table(rows: list[dict]) -> list[list[str]]:
    """Per latent rank, ours and MHA2MLA's Table 1: their KV cut and average at that d_kv (4 pairs),
    our plan's cut and losses right after conversion and after each objective."""
    ranks = sorted({r["rank"] for r in rows if r["rank"] is not None} | set(MHA2MLA_TABLE1), reverse=True)
    table = []
    for rank in ranks:
        theirs = MHA2MLA_TABLE1.get(rank)
        mine = [r for r in rows if r["rank"] == rank]
        converted, after = _after(mine)
        plans = ", ".join(dict.fromkeys(f"{r['select']} r={r['keep_pairs']}" for r in mine)) or "—"
        table.append([str(rank), "—" if theirs is None else f"{100 * theirs[0]:.2f}%",
                      "—" if theirs is None else f"{theirs[1]:.2f}", plans,
                      f"{-100 * mine[0]['cache_saved']:.2f}%" if mine else "—",
                      _fmt(converted), _fmt(after["KD"]), _fmt(after["CE"])])
    return table


def conversion_section(study_dir: Path):
    """The section (markdown, HTML, the curves' image), or None when no run started from a source."""
    rows = conversion_rows(study_dir)
    if not rows:
        return None
    score_names = list(dict.fromkeys(name for r in rows for name in r["scores"]))
    score_names.sort(key=lambda name: "acc@1" not in name)  # long context first, then lm-eval, as `_scores`
    header = ["run", "plan", "cache per token and layer (bf16)", "objective", "tokens", "loss after conversion",
              "KL after conversion", "final val loss", "final KL (held out)", "final KL (train)", *score_names]
    body = [[r["run"], f"{r['select']} r={r['keep_pairs']}" + (f", latent d={r['rank']}" if r["rank"] else ""),
             _cache(r), r["objective"], f"{r['tokens']:,}", _fmt(r["loss_converted"]), _fmt(r["kl_converted"]),
             _fmt(r["final_val_loss"]), _fmt(r["final_kl"]), _fmt(r["final_train_kl"]),
             *(r["scores"].get(n, "—") for n in score_names)]
            for r in rows]
    tables = [(header, body)]
    order_header = ["strategy", "MHA2MLA avg (higher is better)", "our loss after conversion", "after KD", "after CE"]
    if any(r["rank"] is None and r["select"] != "full" for r in rows):
        tables.append((order_header, ordering(rows)))
    latent_header = ["latent rank d", "MHA2MLA KV cut", "MHA2MLA avg (source 44.50)", "our plan", "our KV cut",
                     "our loss after conversion", "after KD", "after CE"]
    if any(r["rank"] is not None for r in rows):
        tables.append((latent_header, latent_table(rows)))
    source = next((r["loss_source"] for r in rows if r["loss_source"] is not None), None)
    intro = (f"Loss and KL on the runs' validation windows (nats/token); the source's loss there is {_fmt(source)}. "
             "KL(source || run) after conversion and at the end on the same held-out windows in fp32 "
             "(`ropelab.study.conversion_check`); final KL (train): the KD term of the last training batch. "
             "Scores of the study's long-context and lm-eval evaluations where it ran them. MHA2MLA "
             "(arXiv 2502.14837 v1, SmolLM-135M, 2.25B tokens of fine-tuning): six-task commonsense average, "
             "Table 5 for partial RoPE alone (r = 4), Table 1 for the latent (r = 4 pairs and rank d_kv).")
    markdown = "\n\n".join([intro, "![conversion curves](conversion_curves.png)",
                            *(markdown_table(h, b) for h, b in tables)])
    html = f"<p>{intro}</p><img src='conversion_curves.png'>" + "".join(html_table(h, b) for h, b in tables)
    return Section("RoPE conversion and recovery", markdown, html, {"conversion_curves.png": _curves(rows)})
