"""Study report: read every run of a study, summarise it, and write tables, plots and text.

Layout read::

    study_dir/runs/<run_id>/config.yaml     resolved run config (see `ropelab.config.RunConfig`)
    study_dir/runs/<run_id>/metrics.jsonl   one row per logged step (`ropelab.train.loop`)
    study_dir/runs/<run_id>/result.json     present when the run finished
    study_dir/runs/<run_id>/error.txt       present when the run failed (its text is the error)

Written by `write_report` (into `study_dir` unless `out_dir` is given): summary.csv,
summary.json, loss_curves.png, final_loss.png, report.md and a self-contained report.html.

Runs are compared inside *comparison groups*: runs whose configs are equal once the seed, the
RoPE fraction / rotary_dims and bookkeeping keys (device, progress, eval / checkpoint cadence)
are removed. Convergence bands and the steps-to-target reference (full RoPE's final loss) are
computed per group; the noise that sets the band threshold is pooled over the whole study.

Command line: ``python -m ropelab.study.report STUDY_DIR [--target LOSS] [--out DIR]``.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from ropelab.config import DataConfig, ModelConfig, TrainConfig, build_run_config
from ropelab.study import analysis

__all__ = ["Run", "collect_runs", "summarize", "write_report", "fraction_label", "COLUMNS"]

TAIL_FRACTION = 0.1  # final loss = mean over the last 10 % of steps
BAND_FACTOR = 3.0  # a new band starts where consecutive final losses differ by > 3 x noise
ZOOM_FRACTION = 0.3  # the zoomed loss panel shows the last 30 % of training

# Keys that never change what a run learns; ignored when grouping runs.
BOOKKEEPING = {
    "seed", "train.device", "train.progress", "train.compile", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
    "model.vocab_size",  # follows the tokenizer (data.tokenizer), filled in at train time
}
ROPE_AMOUNT = {"model.rope.fraction", "model.rope.rotary_dims"}

COLUMNS = [
    "id", "status", "group", "block", "fraction", "fraction_label", "rotary_dims", "head_dim", "seq_len",
    "dataset", "seed", "lr", "steps", "final_train_loss", "final_val_loss", "band", "spikes",
    "unrecovered_spikes", "tokens", "wall_time_s", "tokens_per_s", "target_loss", "steps_to_target",
    "tokens_to_target", "model", "qk_norm", "nominal_fraction", "error",
]


# ------------------------------------------------------------------------------ reading


@dataclass
class Run:
    """One run directory as read from disk.

    status: ``done`` (result.json), ``failed`` (error.txt), ``incomplete`` (neither: still
    running or killed) or ``invalid`` (no readable config.yaml)."""

    id: str
    path: Path
    status: str
    config: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    result: Optional[dict] = None
    error: Optional[str] = None

    def _column(self, key: str, rows: list) -> np.ndarray:
        return np.array([float(r.get(key, math.nan)) if r.get(key) is not None else math.nan for r in rows])

    @property
    def train_rows(self) -> list:
        return [r for r in self.metrics if "loss" in r]

    @property
    def steps(self) -> np.ndarray:
        return np.array([int(r["step"]) for r in self.train_rows], dtype=np.int64)

    @property
    def losses(self) -> np.ndarray:
        return self._column("loss", self.train_rows)

    @property
    def tokens(self) -> np.ndarray:
        return self._column("tokens", self.train_rows)

    @property
    def val(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [r for r in self.metrics if r.get("val_loss") is not None]
        return np.array([int(r["step"]) for r in rows], dtype=np.int64), self._column("val_loss", rows)


def _read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows, sorted by step; unreadable lines (a crash mid-write) are skipped and
    a step logged twice keeps its last row."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


def collect_runs(study_dir: str | Path) -> list[Run]:
    """Every run directory under ``study_dir/runs/``, sorted by name."""
    runs_dir = Path(study_dir) / "runs"
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"{runs_dir}: no runs folder; expected {Path(study_dir)}/runs/<run_id>/")
    runs = []
    for path in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        run = Run(id=path.name, path=path, status="incomplete")
        cfg_path = path / "config.yaml"
        try:
            run.config = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
            if not isinstance(run.config, dict):
                raise yaml.YAMLError("top level is not a mapping")
        except (yaml.YAMLError, OSError) as exc:
            run.config, run.status, run.error = {}, "invalid", f"config.yaml unreadable: {exc}".splitlines()[0]
        run.metrics = _read_metrics(path / "metrics.jsonl")
        result_path = path / "result.json"
        if result_path.is_file():
            try:
                run.result = json.loads(result_path.read_text())
            except json.JSONDecodeError:
                run.result = None
        error_path = path / "error.txt"
        if error_path.is_file():
            run.status = "failed"
            run.error = error_path.read_text(errors="replace").strip() or "error.txt (empty)"
        elif run.status != "invalid":
            if not cfg_path.is_file():
                run.status, run.error = "invalid", "no config.yaml"
            elif run.result is not None:
                run.status = "done"
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------- summary


def _flatten(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: tree}


def _key(config: dict, drop: set) -> str:
    flat = {k: v for k, v in _flatten(config).items() if k not in drop}
    return json.dumps(flat, sort_keys=True, default=str)


def _normalized(config: dict) -> dict:
    """The config with every default filled in (as training resolved it), so a partial and a
    complete config of the same run compare equal; the raw config when it does not load."""
    import copy

    try:
        return build_run_config(copy.deepcopy(config)).to_dict()
    except Exception:  # an older / newer config layout: compare what is there
        return config


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return default
        node = node[part]
    return node


_MODEL, _DATA, _TRAIN = ModelConfig(), DataConfig(), TrainConfig()


def fraction_label(rotary_dims: int, head_dim: int, nominal: Optional[float] = None) -> str:
    """Short name of a RoPE amount: ``NoPE``, ``2 ch``, ``25%`` (the nominal fraction when known),
    ``full``."""
    if rotary_dims == 0:
        return "NoPE"
    if rotary_dims >= head_dim:
        return "full"
    if rotary_dims == 2:
        return "2 ch"
    if nominal is not None and 0 < nominal < 1:
        return f"{100 * nominal:g}%"
    return f"{100 * rotary_dims / head_dim:.3g}%"


def _finite(x: Any) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _run_facts(cfg: dict) -> dict:
    from ropelab.rope import resolve_rotary_dims

    d_model = int(_get(cfg, "model.d_model", _MODEL.d_model))
    n_head = int(_get(cfg, "model.n_head", _MODEL.n_head))
    head_dim = int(_get(cfg, "model.head_dim", None) or d_model // n_head)
    nominal = float(_get(cfg, "model.rope.fraction", 1.0))
    explicit = _get(cfg, "model.rope.rotary_dims", None)
    rotary_dims = resolve_rotary_dims(head_dim, nominal, explicit)
    return {
        "block": _get(cfg, "model.block", _MODEL.block),
        "model": _get(cfg, "model.name", _MODEL.name),
        "qk_norm": bool(_get(cfg, "model.qk_norm", _MODEL.qk_norm)),
        "head_dim": head_dim,
        "rotary_dims": rotary_dims,
        "fraction": rotary_dims / head_dim,
        "nominal_fraction": nominal if explicit is None else rotary_dims / head_dim,
        "fraction_label": fraction_label(rotary_dims, head_dim, nominal if explicit is None else None),
        "seq_len": int(_get(cfg, "data.seq_len", _DATA.seq_len)),
        "dataset": str(_get(cfg, "data.corpus", _DATA.corpus)),
        "seed": _get(cfg, "seed", 0),
        "lr": _finite(_get(cfg, "train.lr", _TRAIN.lr)),
    }


def _group_labels(keys: dict[str, str]) -> dict[str, str]:
    """Readable name for each comparison-group key: the config values that differ between groups."""
    unique = list(dict.fromkeys(keys.values()))
    if len(unique) == 1:
        return {unique[0]: "all"}
    flats = {k: json.loads(k) for k in unique}
    names = sorted(set().union(*flats.values()))
    varying = [n for n in names if len({json.dumps(f.get(n), default=str) for f in flats.values()}) > 1]
    preferred = ["model.block", "data.seq_len", "data.corpus", "model.qk_norm", "train.lr"]
    varying.sort(key=lambda n: (preferred.index(n) if n in preferred else len(preferred), n))
    short = {"data.corpus": "dataset"}
    labels = {}
    for k, flat in flats.items():
        parts = [f"{short.get(n, n.split('.')[-1])}={flat.get(n, '-')}" for n in varying[:4]]
        labels[k] = ", ".join(parts) + (", ..." if len(varying) > 4 else "")
    return labels


def _spike_kwargs(n: int) -> dict:
    # window: 50 points, fewer for short runs (but enough for a median)
    return {"window": int(min(50, max(10, n // 10)))}


def summarize(
    runs: list[Run],
    target: Optional[float] = None,
    tail_fraction: float = TAIL_FRACTION,
    band_factor: float = BAND_FACTOR,
) -> list[dict]:
    """One row per run (keys: `COLUMNS`), ordered by group, fraction, seed.

    final_train_loss: mean training loss over the last `tail_fraction` of steps.
    final_val_loss: result.json's, else the last logged val_loss.
    band: convergence band inside the run's comparison group (0 = lowest loss), for finished
      runs only; the noise is `analysis.estimate_noise` over all finished runs, with seed
      replicas (runs that differ only by seed) when there are any.
    steps_to_target / tokens_to_target: first step (tokens) where the smoothed training loss
      reaches `target`, or by default the final loss of full RoPE in the same group (mean over
      its seeds); ``target_loss`` says which value was used.
    The study-level facts (noise, its source, threshold) are attached to every row under the
    private key ``_study``, which `write_report` uses and the CSV omits.
    """
    valid = [r for r in runs if r.status != "invalid"]
    configs = {r.id: _normalized(r.config) for r in valid}
    facts = {r.id: _run_facts(configs[r.id]) for r in valid}
    group_key = {r.id: _key(configs[r.id], BOOKKEEPING | ROPE_AMOUNT) for r in valid}
    seed_key = {r.id: _key(configs[r.id], BOOKKEEPING) for r in valid}
    labels = _group_labels(group_key) if valid else {}
    for r in runs:
        if r.status == "invalid":
            facts[r.id], group_key[r.id] = {}, ""
    labels[""] = "—"

    curves = {r.id: (r.steps, r.losses) for r in runs}
    finals = {r.id: analysis.final_loss(*curves[r.id], tail_fraction=tail_fraction) for r in runs}
    done = [r for r in runs if r.status == "done" and math.isfinite(finals[r.id])]

    seed_groups: dict[str, list[str]] = {}
    for r in done:
        seed_groups.setdefault(seed_key[r.id], []).append(r.id)
    noise, source = analysis.estimate_noise(
        {r.id: curves[r.id] for r in done}, list(seed_groups.values()), tail_fraction, return_source=True
    )
    bands: dict[str, Optional[int]] = {}
    targets: dict[str, Optional[float]] = {}
    for key in dict.fromkeys(group_key[r.id] for r in valid):
        members = [r for r in done if group_key[r.id] == key]
        if math.isfinite(noise):
            bands |= analysis.convergence_bands({r.id: finals[r.id] for r in members}, noise, band_factor)
        full = [finals[r.id] for r in members if facts[r.id]["rotary_dims"] >= facts[r.id]["head_dim"]]
        targets[key] = float(target) if target is not None else (float(np.mean(full)) if full else None)

    rows = []
    for r in runs:
        f = facts[r.id]
        steps, losses, tokens = curves[r.id] + (r.tokens,)
        spikes = analysis.detect_spikes(steps, losses, **_spike_kwargs(len(losses))) if len(losses) else []
        res = r.result or {}
        val_steps, val_losses = r.val
        final_val = _finite(res.get("final_val_loss"))
        if final_val is None and len(val_losses):
            final_val = _finite(val_losses[-1])
        tgt = targets.get(group_key[r.id])
        stt = analysis.steps_to_target(steps, losses, tgt) if tgt is not None and len(losses) else None
        tok_to = None
        if stt is not None:
            tok_to = _finite(tokens[int(np.searchsorted(steps, stt))])
        last = r.metrics[-1] if r.metrics else {}
        rows.append({
            "id": r.id,
            "status": r.status,
            "group": labels.get(group_key[r.id], "all"),
            "block": f.get("block"),
            "fraction": f.get("fraction"),
            "fraction_label": f.get("fraction_label"),
            "rotary_dims": f.get("rotary_dims"),
            "head_dim": f.get("head_dim"),
            "seq_len": f.get("seq_len"),
            "dataset": f.get("dataset"),
            "seed": f.get("seed"),
            "lr": f.get("lr"),
            "steps": int(res.get("steps") or (steps[-1] if len(steps) else 0)),
            "final_train_loss": _finite(finals[r.id]),
            "final_val_loss": final_val,
            "band": bands.get(r.id),
            "spikes": len(spikes),
            "unrecovered_spikes": sum(not s.recovered for s in spikes),
            "tokens": int(res.get("tokens") or last.get("tokens") or 0),
            "wall_time_s": _finite(res.get("wall_time_s")),
            "tokens_per_s": _finite(res.get("tokens_per_s"))
            or _finite(np.nanmedian([x.get("tokens_per_s", math.nan) for x in r.metrics]) if r.metrics else None),
            "target_loss": tgt,
            "steps_to_target": stt,
            "tokens_to_target": tok_to,
            "model": f.get("model"),
            "qk_norm": f.get("qk_norm"),
            "nominal_fraction": f.get("nominal_fraction"),
            "error": r.error,
            "spike_list": [s.to_dict() for s in spikes],
            "_study": {"noise": _finite(noise), "noise_source": source, "band_factor": band_factor,
                       "seed_groups": sum(len(g) >= 2 for g in seed_groups.values()),
                       "tail_fraction": tail_fraction, "target": target},
        })
    order = {label: i for i, label in enumerate(sorted(set(labels.values())))}
    rows.sort(key=lambda row: (order.get(row["group"], 0), row["fraction"] if row["fraction"] is not None else -1,
                               str(row["seed"]), row["id"]))
    return rows


# ------------------------------------------------------------------------------ plots

BAND_CMAPS = ["Blues", "Oranges", "Greens", "Reds", "Purples", "Greys", "YlOrBr", "BuGn"]


def _band_colors(rows: list[dict]) -> dict[str, Any]:
    """Colour per run id: one colour family per band (shades within a band), grey for no band."""
    from matplotlib import colormaps

    colors: dict[str, Any] = {}
    by_band: dict[tuple, list[dict]] = {}
    for row in rows:
        by_band.setdefault((row["group"], row["band"]), []).append(row)
    for (_, band), members in by_band.items():
        members.sort(key=lambda r: (r["final_train_loss"] if r["final_train_loss"] is not None else math.inf))
        for i, row in enumerate(members):
            if band is None:
                colors[row["id"]] = (0.55, 0.55, 0.55, 1.0)
                continue
            cmap = colormaps[BAND_CMAPS[band % len(BAND_CMAPS)]]
            shade = 0.85 - 0.4 * (i / max(len(members) - 1, 1)) if len(members) > 1 else 0.7
            colors[row["id"]] = cmap(shade)
    return colors


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _run_label(row: dict, multi_seed: bool) -> str:
    text = f"{row['fraction_label']} ({row['rotary_dims']}/{row['head_dim']})"
    if multi_seed:
        text += f" s{row['seed']}"
    if row["band"] is not None:
        text += f" · band {row['band']}"
    elif row["status"] != "done":
        text += f" · {row['status']}"
    return text


def plot_loss_curves(rows: list[dict], runs: list[Run]) -> bytes:
    """Smoothed training loss vs tokens, a row of panels per comparison group: the whole run and
    a zoom on the last 30 % of training. Colour family = band, ▼ on top = a spike (red:
    unrecovered)."""
    from matplotlib.transforms import blended_transform_factory

    by_id = {r.id: r for r in runs}
    groups = list(dict.fromkeys(row["group"] for row in rows)) or ["all"]
    colors = _band_colors(rows)
    fig = _figure(13, 3.6 * len(groups))
    axes = fig.subplots(len(groups), 2, squeeze=False)
    for g, group in enumerate(groups):
        ax_full, ax_zoom = axes[g]
        members = [row for row in rows if row["group"] == group and len(by_id[row["id"]].losses)]
        replicated = _replicated(members)
        t_max, zoom_vals, full_vals = 0.0, [], []
        curves = []
        for row in members:
            run = by_id[row["id"]]
            x = run.tokens
            if not np.any(np.isfinite(x)):
                x = run.steps.astype(float)
            # EMA for display: no noisy raw points at the right edge (a centered mean's ends)
            y = analysis.smooth(run.losses, max(5, len(run.losses) // 50), kind="ema")
            curves.append((row, x, y))
            t_max = max(t_max, float(np.nanmax(x)))
        for row, x, y in curves:
            style = "-" if row["status"] == "done" else "--"
            label = _run_label(row, row["fraction"] in replicated)
            ax_full.plot(x, y, style, color=colors[row["id"]], lw=1.3, label=label)
            zoom = x >= (1 - ZOOM_FRACTION) * t_max
            ax_zoom.plot(x[zoom], y[zoom], style, color=colors[row["id"]], lw=1.5, label=label)
            zoom_vals.append(y[zoom])
            full_vals.append(y[x >= 0.1 * t_max])  # skip the first 10 %: the early drop
            trans = blended_transform_factory(ax_full.transData, ax_full.transAxes)
            steps = by_id[row["id"]].steps
            for spike in row["spike_list"]:
                k = min(int(np.searchsorted(steps, spike["step"])), len(x) - 1)
                ax_full.plot([x[k]], [0.97], "v", ms=8, transform=trans,
                             color="red" if not spike["recovered"] else "orange", clip_on=False)
        _set_ylim(ax_full, full_vals)
        _set_ylim(ax_zoom, zoom_vals)
        if t_max > 0:
            ax_zoom.set_xlim((1 - ZOOM_FRACTION) * t_max, t_max * 1.005)
        name = "" if group == "all" else f" — {group}"
        ax_full.set_title(f"training loss (EMA-smoothed){name}", fontsize=10)
        ax_zoom.set_title(f"last {ZOOM_FRACTION:.0%} of training", fontsize=10)
        for ax in (ax_full, ax_zoom):
            ax.set_xlabel("tokens")
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
        if curves:
            ax_zoom.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
        else:
            ax_full.text(0.5, 0.5, "no metrics", ha="center", va="center", transform=ax_full.transAxes)
    fig.tight_layout()
    return _png(fig)


def _set_ylim(ax, values: list[np.ndarray]) -> None:
    flat = np.concatenate(values) if values else np.array([])
    flat = flat[np.isfinite(flat)]
    if flat.size:
        lo, hi = float(flat.min()), float(flat.max())
        pad = 0.05 * (hi - lo) or 0.01 * max(abs(hi), 1e-3)
        ax.set_ylim(lo - pad, hi + pad)


def plot_final_loss(rows: list[dict]) -> bytes:
    """Final loss vs RoPE fraction, one line per comparison group (mean over seeds, ± std when
    there are replicas, each run a faint dot); a second panel for validation loss when logged."""
    finished = [r for r in rows if r["final_train_loss"] is not None and r["fraction"] is not None]
    has_val = any(r["final_val_loss"] is not None for r in finished)
    fig = _figure(6.5 * (2 if has_val else 1), 4.2)
    axes = fig.subplots(1, 2 if has_val else 1, squeeze=False)[0]
    fractions = sorted({round(r["fraction"], 4) for r in finished})
    pos = {f: i for i, f in enumerate(fractions)}
    ticks = []
    for f in fractions:
        same = [r for r in finished if round(r["fraction"], 4) == f]
        dims = sorted({f"{r['rotary_dims']}/{r['head_dim']}" for r in same})
        ticks.append(f"{same[0]['fraction_label']}\n{f:.3g}\n{', '.join(dims)}")  # name / value / dims
    groups = list(dict.fromkeys(r["group"] for r in finished))
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    for ax, key, title in zip(axes, ("final_train_loss", "final_val_loss"), ("final training loss", "final validation loss")):
        for g, group in enumerate(groups):
            color = palette(g % 10)
            xs, means, stds = [], [], []
            for f in fractions:
                vals = [r[key] for r in finished if r["group"] == group and round(r["fraction"], 4) == f
                        and r[key] is not None and r["status"] == "done"]
                if not vals:
                    continue
                ax.plot([pos[f]] * len(vals), vals, "o", color=color, alpha=0.3, ms=4)
                xs.append(pos[f])
                means.append(float(np.mean(vals)))
                stds.append(float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0)
            if xs:
                ax.errorbar(xs, means, yerr=stds if any(stds) else None, fmt="-o", color=color, lw=1.5,
                            capsize=3, label=group if group != "all" else "all runs")
        ax.set_xticks(range(len(fractions)))
        ax.set_xticklabels(ticks, fontsize=8)
        ax.set_xlabel("RoPE fraction = rotary_dims / head_dim")
        ax.set_ylabel("loss")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return _png(fig)


# ------------------------------------------------------------------------------- text


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "—"
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    return str(v)


def _replicated(rows: list[dict]) -> set:
    """Fractions that have more than one run (seed replicas) among `rows`."""
    seen: dict = {}
    for r in rows:
        seen[r["fraction"]] = seen.get(r["fraction"], 0) + 1
    return {f for f, n in seen.items() if n > 1}


def _who(row: dict, with_seed: bool) -> str:
    return row["fraction_label"] + (f" s{row['seed']}" if with_seed else "")


def _names(rows: list[dict], replicated: set) -> str:
    return ", ".join(_who(r, r["fraction"] in replicated) for r in rows)


def _spike_text(spike: dict) -> str:
    size = "diverged" if not math.isfinite(spike["loss"]) else f"+{100 * spike['jump']:.0f}%"
    return f"step {spike['step']} {size}" + ("" if spike["recovered"] else " unrecovered")


def findings(rows: list[dict]) -> list[str]:
    """The report's sentences, stated from the data (one string per bullet, Markdown-light:
    only `code` spans)."""
    if not rows:
        return ["No runs found under runs/."]
    study = rows[0]["_study"]
    out = []
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "incomplete", "invalid")}
    out.append(f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".")
    noise, factor = study["noise"], study["band_factor"]
    if noise is None:
        out.append("Run-to-run noise could not be estimated (no finished run with enough logged steps), "
                   "so no convergence bands were formed.")
    elif study["noise_source"] == "seeds":
        out.append(f"Noise of the final loss: {noise:.4g}, the pooled standard deviation over "
                   f"{study['seed_groups']} group(s) of seed replicas; a new band starts where sorted final "
                   f"losses differ by more than {factor:g} × noise = {factor * noise:.4g}.")
    else:
        out.append(f"Noise of the final loss: {noise:.4g}, estimated from each run's own loss tail (no seed "
                   f"replicas); this counts batch noise only, a lower bound on seed-to-seed variation, so bands "
                   f"may split runs a second seed would merge. Band threshold {factor:g} × noise = "
                   f"{factor * noise:.4g}.")
    for group in dict.fromkeys(r["group"] for r in rows if r["status"] != "invalid"):
        members = [r for r in rows if r["group"] == group and r["band"] is not None]
        where = "" if group == "all" else f"Group `{group}`: "
        if not members:
            out.append(f"{where}no finished run to compare.")
            continue
        replicated = _replicated(members)
        n_bands = max(r["band"] for r in members) + 1
        desc = []
        for b in range(n_bands):
            inb = sorted((r for r in members if r["band"] == b), key=lambda r: (r["fraction"], str(r["seed"])))
            lo = min(r["final_train_loss"] for r in inb)
            hi = max(r["final_train_loss"] for r in inb)
            span = f"{lo:.4f}" if len(inb) == 1 else f"{lo:.4f}–{hi:.4f}"
            desc.append(f"band {b} ({span}): {_names(inb, replicated)}")
        full = [r for r in members if r["rotary_dims"] >= r["head_dim"]]
        if len(members) == 1:
            out.append(f"{where}only one finished run ({_who(members[0], False)}); no bands to compare.")
        elif n_bands == 1:
            spread = max(r["final_train_loss"] for r in members) - min(r["final_train_loss"] for r in members)
            ratio = f" = {spread / noise:.1f} × noise" if noise else ""
            out.append(f"{where}no separate band found at this scale: all {len(members)} finished runs end within "
                       f"noise of each other (final-loss spread {spread:.4g}{ratio}).")
        else:
            out.append(f"{where}{n_bands} bands — " + "; ".join(desc) + ".")
        if full:
            fb = sorted({r["band"] for r in full})
            full_loss = float(np.mean([r["final_train_loss"] for r in full]))
            sharing = sorted({r["fraction_label"] for r in members if r["band"] in fb and r["rotary_dims"] < r["head_dim"]},
                             key=lambda lab: min(r["fraction"] for r in members if r["fraction_label"] == lab))
            outside = [r for r in members if r["band"] not in fb]
            text = f"{where}full RoPE (final loss {full_loss:.4f}) is in band {', '.join(map(str, fb))}"
            text += f", shared with: {', '.join(sharing)}" if sharing else ", alone (no other fraction shares it)"
            if outside:
                gaps = ", ".join(
                    f"{_who(r, r['fraction'] in replicated)} (band {r['band']}, {r['final_train_loss'] - full_loss:+.4f})"
                    for r in sorted(outside, key=lambda r: r["final_train_loss"]))
                text += f"; outside it: {gaps}"
            out.append(text + ".")
        else:
            out.append(f"{where}no finished full-RoPE run, so no band is named as full RoPE's.")
        reach = [r for r in members if r["target_loss"] is not None]
        if reach:
            tgt = reach[0]["target_loss"]
            what = "the given target" if study["target"] is not None else "full RoPE's final loss"
            parts = [_who(r, r["fraction"] in replicated) + " " + (f"step {r['steps_to_target']}" if r["steps_to_target"] is not None
                                              else "never") for r in reach]
            out.append(f"{where}steps to reach {what} ({tgt:.4f}, smoothed loss): " + "; ".join(parts) + ".")
    spiky = [r for r in rows if r["spikes"]]
    if not spiky:
        out.append("Loss spikes: none found in any run.")
    else:
        total = sum(r["spikes"] for r in spiky)
        unrec = sum(r["unrecovered_spikes"] for r in spiky)
        detail = "; ".join(
            f"`{r['id']}` ({r['fraction_label']}): " + ", ".join(_spike_text(s) for s in r["spike_list"])
            for r in spiky)
        out.append(f"Loss spikes: {total} found in {len(spiky)} run(s), {unrec} unrecovered — {detail}.")
    for r in rows:
        if r["status"] in ("failed", "invalid"):
            first = (r["error"] or "").strip().splitlines()
            out.append(f"Run `{r['id']}` {r['status']}: {first[-1] if first else 'no error text'}")
    return out


TABLE_COLUMNS = [
    ("id", "run"), ("status", "status"), ("group", "group"), ("fraction_label", "RoPE"), ("fraction", "fraction"),
    ("rotary_dims", "rot. dims"), ("seed", "seed"), ("final_train_loss", "train loss"),
    ("final_val_loss", "val loss"), ("band", "band"), ("spikes", "spikes"), ("unrecovered_spikes", "unrec."),
    ("steps_to_target", "steps→target"), ("tokens", "tokens"), ("tokens_per_s", "tok/s"), ("wall_time_s", "wall s"),
]


def _table_columns(rows: list[dict]) -> list[tuple[str, str]]:
    cols = TABLE_COLUMNS
    if len({r["group"] for r in rows}) <= 1:
        cols = [c for c in cols if c[0] != "group"]
    return cols


def _cell(row: dict, key: str) -> str:
    v = row[key]
    if key == "fraction" and v is not None:
        return f"{v:.3f}"
    if key in ("final_train_loss", "final_val_loss") and v is not None:
        return f"{v:.4f}"
    if key in ("tokens_per_s", "wall_time_s") and v is not None:
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return _fmt(v)


def render_markdown(rows: list[dict]) -> str:
    cols = _table_columns(rows)
    lines = ["# Partial-RoPE study report", ""]
    lines += [f"- {s}" for s in findings(rows)]
    lines += ["", "![loss curves](loss_curves.png)", "", "![final loss vs fraction](final_loss.png)", "",
              "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k).replace("|", "\\|") for k, _ in cols) + " |")
    lines += ["", f"Final loss = mean training loss over the last {rows[0]['_study']['tail_fraction']:.0%} of steps"
              if rows else "", ""]
    return "\n".join(lines)


def _inline(text: str) -> str:
    """HTML of a findings sentence: escaped, with `code` spans."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(rows: list[dict], images: dict[str, bytes]) -> str:
    from matplotlib import colormaps

    cols = _table_columns(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = []
    for row in rows:
        cells = []
        for key, _ in cols:
            style = ""
            if key == "band" and row["band"] is not None:
                r, g, b, _a = colormaps[BAND_CMAPS[row["band"] % len(BAND_CMAPS)]](0.35)
                style = f' style="background: rgb({r * 255:.0f},{g * 255:.0f},{b * 255:.0f})"'
            if key == "status" and row["status"] != "done":
                style = ' class="bad"'
            if key == "unrecovered_spikes" and row[key]:
                style = ' class="bad"'
            cells.append(f"<td{style}>{html.escape(_cell(row, key))}</td>")
        title = f' title="{html.escape(row["error"])}"' if row["error"] else ""
        body.append(f"<tr{title}>{''.join(cells)}</tr>")
    bullets = "".join(f"<li>{_inline(s)}</li>" for s in findings(rows))
    figs = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, data in images.items()
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Partial-RoPE study report</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1400px;
       color: #222; padding: 0 1em; line-height: 1.45; }}
h1 {{ font-size: 1.5em; }} code {{ background: #f2f2f2; padding: 0 .25em; border-radius: 3px; }}
figure {{ margin: 1.5em 0; }} figure img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #666; font-size: .85em; }}
table {{ border-collapse: collapse; font-size: .85em; margin-top: 1em; }}
th, td {{ border: 1px solid #ccc; padding: .3em .6em; text-align: right; white-space: nowrap; }}
th {{ background: #333; color: #fff; position: sticky; top: 0; }}
td:first-child, th:first-child {{ text-align: left; }}
tr:nth-child(even) td {{ background-color: #fafafa; }}
td.bad {{ color: #b00; font-weight: 600; }}
</style></head><body>
<h1>Partial-RoPE study report</h1>
<ul>{bullets}</ul>
{figs}
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
</body></html>
"""


# ------------------------------------------------------------------------------ write


def _json_safe(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, np.generic):
        return _json_safe(v.item())
    return v


def write_report(
    study_dir: str | Path, target: Optional[float] = None, out_dir: str | Path | None = None
) -> dict[str, Path]:
    """Read ``study_dir/runs/*`` and write summary.csv, summary.json, loss_curves.png,
    final_loss.png, report.md and report.html into `out_dir` (default `study_dir`).
    Returns ``{file name: path}``."""
    runs = collect_runs(study_dir)
    rows = summarize(runs, target=target)
    out = Path(out_dir) if out_dir is not None else Path(study_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in
             ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html")}

    with open(paths["summary.csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k]))
                             for k in COLUMNS})
    study = rows[0]["_study"] if rows else {}
    payload = {"study": study, "runs": [{k: v for k, v in row.items() if k != "_study"} for row in rows]}
    paths["summary.json"].write_text(json.dumps(_json_safe(payload), indent=2) + "\n")

    images = {"loss_curves.png": plot_loss_curves(rows, runs), "final_loss.png": plot_final_loss(rows)}
    for name, data in images.items():
        paths[name].write_bytes(data)
    paths["report.md"].write_text(render_markdown(rows))
    paths["report.html"].write_text(render_html(rows, images))
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ropelab.study.report", description=__doc__.split("\n")[0])
    parser.add_argument("study_dir")
    parser.add_argument("--target", type=float, help="loss target for steps_to_target (default: full RoPE's final loss)")
    parser.add_argument("--out", help="output folder (default: the study folder)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.study_dir, args.target, args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}")
        return 2
    for path in paths.values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
