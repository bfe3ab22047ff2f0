"""The distillation claims' figures, as PNG bytes: loss by position, the probe's perturbation by
repeat, and the query weights' change per rotary pair."""

from __future__ import annotations

from typing import Mapping, Sequence

from ropelab.study.plots import new_figure, png_bytes


def _seed_lines(ax, series: Mapping[str, Sequence[Sequence[float]]], xs: Sequence[float]) -> None:
    """One colour per group, one line per seed (the first labelled)."""
    for index, (name, lines) in enumerate(series.items()):
        for seed, values in enumerate(lines):
            ax.plot(xs, values, "o-", ms=3, lw=1.2, color=f"C{index}", alpha=1.0 if seed == 0 else 0.6,
                    label=name if seed == 0 else None)


def plot_loss_by_position(positions: Sequence[int], curves: Mapping[str, Sequence[Sequence[float]]], length: int) -> bytes:
    """Loss against the first position of each bucket (log axis), the phase-1 length marked."""
    fig = new_figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    _seed_lines(ax, curves, positions)
    ax.axvline(length, color="grey", ls="--", lw=1, label=f"phase-1 length ({length})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position (first of its bucket)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig)


def plot_repeat_kl(lines: Mapping[str, Sequence[float]], block_len: int) -> bytes:
    """KL of each repeat's next-token distribution to the first repeat's, against its position."""
    fig = new_figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for index, (name, values) in enumerate(lines.items()):
        xs = [(r + 1) * block_len for r in range(1, len(values))]
        ax.plot(xs, [max(v, 1e-12) for v in values[1:]], "o-", ms=3, lw=1.2, color=f"C{index}", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("position of the repeat's last token")
    ax.set_ylabel("KL to the first repeat (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig)


def plot_pair_changes(per_seed: Sequence[Sequence[float]], bands: Mapping[str, range]) -> bytes:
    """Relative change of W_q per rotary pair, one line per seed, the frequency bands shaded."""
    fig = new_figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for index, (name, pairs) in enumerate(bands.items()):
        ax.axvspan(pairs.start - 0.5, pairs.stop - 0.5, color=f"C{index + 3}", alpha=0.12, label=name)
    for seed, values in enumerate(per_seed):
        ax.plot(range(len(values)), values, "o-", ms=3, lw=1.2, color="C0", alpha=1.0 if seed == 0 else 0.6,
                label=f"seed {seed}")
    ax.set_xlabel("rotary pair (0 = highest frequency)")
    ax.set_ylabel("relative change of W_q, phase 1 -> 2")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig)
