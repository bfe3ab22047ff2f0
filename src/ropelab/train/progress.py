"""The trainer's progress bar (rich) and the status line it shows."""

from __future__ import annotations

import math
from typing import Optional


def progress_bar(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(), disable=not enabled, transient=False,
    )


def model_status(summary: dict) -> str:
    """The status before the first step: the model's size and its rotary share (`model_summary`)."""
    return f"{summary['params'] / 1e6:.1f}M params, rotary {summary['rotary_dims']}/{summary['head_dim']}"


def step_status(phase_name: str, loss: float, val_loss: float, tokens_per_s: float, mfu: Optional[float]) -> str:
    """The status after a step; `val_loss` NaN before the first validation."""
    val_text = f" val {val_loss:.3f}" if not math.isnan(val_loss) else ""
    mfu_text = f" MFU {mfu:.1%}" if mfu is not None else ""
    return f"{phase_name} loss {loss:.3f}{val_text} {tokens_per_s:,.0f} tok/s{mfu_text}"
