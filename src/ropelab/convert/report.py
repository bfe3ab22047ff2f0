"""The picture of a plan: which pairs each layer keeps, one heatmap (layer x pair) per KV head."""

from __future__ import annotations

import numpy as np

from ropelab.study.plots import new_figure, png_bytes


def pairs_heatmap(plans: list[list[list[int]]], n_pairs: int, title: str) -> bytes:
    """PNG: per KV head a layer x pair grid, kept pairs dark; pair 0 (the fastest) on the left."""
    kv_heads = len(plans[0])
    fig = new_figure(1.2 + 3.2 * kv_heads, 1.2 + 0.12 * len(plans))
    for head in range(kv_heads):
        grid = np.zeros((len(plans), n_pairs))
        for layer, kept in enumerate(plans):
            grid[layer, kept[head]] = 1.0
        ax = fig.add_subplot(1, kv_heads, head + 1)
        ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"KV head {head}", fontsize=9)
        ax.set_xlabel("pair (0 = fastest)", fontsize=8)
        if head == 0:
            ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    return png_bytes(fig)
