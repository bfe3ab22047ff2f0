"""Study plots: the report's matplotlib figures (loss curves and final loss vs RoPE fraction), as PNG bytes."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ropelab.study import analysis
from ropelab.study.run_folders import Run
from ropelab.study.summary import replicated_fractions

__all__ = ["BAND_CMAPS", "ZOOM_FRACTION", "plot_loss_curves", "plot_final_loss"]

ZOOM_FRACTION = 0.3  # the zoomed loss panel shows the last 30 % of training

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


def new_figure(width: float, height: float):
    """A matplotlib figure drawn off-screen (Agg), without pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig) -> bytes:
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


def _format_tokens(value: float, _pos=None) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def plot_loss_curves(rows: list[dict], runs: list[Run]) -> bytes:
    """Smoothed training loss vs tokens, a row of panels per comparison group: the whole run and
    a zoom on the last 30 % of training. Colour family = band, ▼ on top = a spike (red:
    unrecovered)."""
    from matplotlib.ticker import FuncFormatter
    from matplotlib.transforms import blended_transform_factory

    by_id = {r.id: r for r in runs}
    groups = list(dict.fromkeys(row["group"] for row in rows)) or ["all"]
    colors = _band_colors(rows)
    fig = new_figure(13, 3.6 * len(groups))
    axes = fig.subplots(len(groups), 2, squeeze=False)
    for g, group in enumerate(groups):
        ax_full, ax_zoom = axes[g]
        members = [row for row in rows if row["group"] == group and len(by_id[row["id"]].losses)]
        replicated = replicated_fractions(members)
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
            ax.xaxis.set_major_formatter(FuncFormatter(_format_tokens))
            ax.set_xlabel("tokens")
            ax.set_ylabel("loss")
            ax.grid(alpha=0.3)
        if curves:
            ax_zoom.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
        else:
            ax_full.text(0.5, 0.5, "no metrics", ha="center", va="center", transform=ax_full.transAxes)
    fig.tight_layout()
    return png_bytes(fig)


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
    fig = new_figure(6.5 * (2 if has_val else 1), 4.2)
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
    return png_bytes(fig)


# ------------------------------------------------------------------------------- text
