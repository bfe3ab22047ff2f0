"""Probe figures as PNG bytes: deviation heatmaps (channel x repeat), distance against position,
and the weight-change heatmap (layer x frequency pair)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ropelab.study.plots import new_figure, png_bytes

MAX_HEATMAP_CHANNELS = 256  # wider stages (the logits' vocabulary) show their most-perturbed channels
MAX_HEATMAP_LAYERS = 6


def _most_perturbed(matrix: np.ndarray, limit: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The `limit` rows with the largest total deviation, in channel order, and their indices
    (None when every row is kept)."""
    if matrix.shape[0] <= limit:
        return matrix, None
    keep = np.sort(np.argsort(-matrix.sum(axis=1), kind="stable")[:limit])
    return matrix[keep], keep


def _spread(items: list, limit: int) -> list:
    """At most `limit` items, evenly spaced, first and last included."""
    if len(items) <= limit:
        return items
    return [items[i] for i in sorted({round(k * (len(items) - 1) / (limit - 1)) for k in range(limit)})]


def plot_deviation_heatmaps(panels: dict[str, list[tuple[str, torch.Tensor, Optional[int]]]], title: str) -> bytes:
    """One heatmap per stage: |x_r - x_0| / rms(x_0) per channel (rows) and repeat (columns), the
    layers side by side (at most `MAX_HEATMAP_LAYERS`, evenly spread). A panel is (title,
    deviation (channels, R) from `metrics.deviation_from_first`, rotary_dims or None); for
    queries and keys a dashed line separates the rotated channels (above) from the unrotated
    ones. Each stage is scaled to its own maximum, given in its title."""
    from matplotlib.ticker import MaxNLocator

    height = 2.2 * len(panels) + 0.6
    fig = new_figure(9.0, height)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    fig.subplots_adjust(top=1 - 0.75 / height, bottom=0.5 / height, hspace=0.55)
    image = None
    for ax, (stage, stage_panels) in zip(axes, panels.items()):
        shown = _spread(stage_panels, MAX_HEATMAP_LAYERS)
        blocks, kept = zip(*(_most_perturbed(dev.numpy(), MAX_HEATMAP_CHANNELS) for _, dev, _ in shown))
        repeats = blocks[0].shape[1]
        gap = np.full((blocks[0].shape[0], 1), np.nan)
        matrix = np.concatenate([part for block in blocks for part in (block, gap)][:-1], axis=1)
        vmax = float(np.nanmax(matrix)) if matrix.size else 0.0
        image = ax.imshow(matrix / (vmax or 1.0), aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=1.0)
        rotary_dims = shown[0][2]
        if rotary_dims is not None and 0 < rotary_dims < shown[0][1].shape[0]:
            ax.axhline(rotary_dims - 0.5, color="cyan", lw=1.0, ls="--")
        if len(shown) > 1:
            ax.set_xticks([i * (repeats + 1) + (repeats - 1) / 2 for i in range(len(shown))])
            ax.set_xticklabels([name for name, _, _ in shown], fontsize=7)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
            ax.tick_params(axis="x", labelsize=7)
        ax.yaxis.set_major_locator(MaxNLocator(4, integer=True))
        ax.tick_params(axis="y", labelsize=7)
        note = "" if kept[0] is None else f", top {len(kept[0])} of {shown[0][1].shape[0]} channels"
        ax.set_title(f"{stage}: max {vmax:.3g}{note}", fontsize=8, loc="left")
    axes[-1].set_xlabel("repeats (per layer, left to right)", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=list(axes), fraction=0.03, pad=0.02, label="deviation / the stage's max")
    fig.suptitle(f"{title}: |x_r - x_0| / rms(x_0), channels x repeats; dashed: rotated channels above", fontsize=9,
                 y=1 - 0.2 / height)
    return png_bytes(fig)


def plot_distance_lines(title: str, series: dict[str, list[dict]]) -> bytes:
    """One panel per stage; a line per (checkpoint, layer): relative L2 distance to the first
    repeat (KL divergence for the logits) against the analysis token's position in the window.

    series: {stage: [{"checkpoint", "layer", "positions", "values"}]}; checkpoints get one
    colour family each, layers shades of it."""
    from matplotlib import colormaps

    stages = list(series)
    cols = min(len(stages), 4) or 1
    rows = max(1, math.ceil(len(stages) / cols))
    fig = new_figure(4.3 * cols, 3.3 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    checkpoints = list(dict.fromkeys(line["checkpoint"] for lines in series.values() for line in lines))
    families = ["Blues", "Oranges", "Greens", "Reds", "Purples", "Greys"]
    for ax, stage in zip(axes, stages):
        lines = series[stage]
        for c, checkpoint in enumerate(checkpoints):
            mine = [line for line in lines if line["checkpoint"] == checkpoint]
            cmap = colormaps[families[c % len(families)]]
            for i, line in enumerate(mine):
                shade = 0.9 - 0.5 * i / max(len(mine) - 1, 1) if len(mine) > 1 else 0.7
                label = checkpoint if line["layer"] is None else f"{checkpoint} L{line['layer']}"
                ax.plot(line["positions"], line["values"], "-", marker=".", ms=3, lw=1.2, color=cmap(shade), label=label)
        ax.set_title(stage, fontsize=9)
        ax.set_xlabel("position of the analysed token")
        ax.set_ylabel("KL to first repeat (nats)" if stage == "logits" else "relative L2 to first repeat")
        ax.grid(alpha=0.3)
    for ax in axes[len(stages):]:
        ax.set_visible(False)
    handles, names = max((ax.get_legend_handles_labels() for ax in axes[: len(stages)]), key=lambda hl: len(hl[1]))
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.02 * math.ceil(len(names) / 6), 1, 1))
    return png_bytes(fig)


def plot_weight_heatmap(changes: dict, title: str) -> bytes:
    """Relative change of W_q and W_k, layer x frequency pair (pair 0 = the fastest-turning),
    with the unrotated channels as the last column; from `weights.weight_changes`."""
    projections = list(changes["heatmap"])
    fig = new_figure(6.0 * len(projections), 0.9 + 0.35 * max(len(changes["layers"]), 4))
    axes = fig.subplots(1, len(projections), squeeze=False)[0]
    for ax, proj in zip(axes, projections):
        rows = changes["heatmap"][proj]
        width = max(len(r) for r in rows)
        matrix = np.full((len(rows), width), np.nan)
        for i, row in enumerate(rows):  # layers may rotate different numbers of pairs
            matrix[i, : len(row) - 1] = [np.nan if v is None else v for v in row[:-1]]
            matrix[i, width - 1] = np.nan if row[-1] is None else row[-1]
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax, label="||ΔW|| / ||W_A|| over the span's rows")
        ax.set_xlabel("frequency pair (0 = highest frequency) | unrotated")
        ax.set_ylabel("layer")
        ticks = list(range(0, width - 1, max(1, (width - 1) // 8))) + [width - 1]
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks[:-1]] + ["unrot."], fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_title(f"W_{proj}: {title}", fontsize=10)
    fig.tight_layout()
    return png_bytes(fig)
