"""Rank-0 metrics: ``metrics.jsonl`` (one JSON row per logged step; validation rows carry
"val_loss"), mirrored to TensorBoard event files in ``<run>/tensorboard`` when the tensorboard
package is installed and ``train.tensorboard`` is on."""

from __future__ import annotations

import json
from pathlib import Path

from ropelab.config import ConfigError
from ropelab.files import write_atomically


class MetricsLog:
    """Append-only metrics.jsonl; on resume, rows after the checkpoint's step are dropped (the
    resumed run writes them again)."""

    def __init__(self, run_dir: Path, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            kept = [r for r in read_metrics(run_dir) if r["step"] <= resume_step]
            write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.file = open(self.path, "a")
        self.board = _summary_writer(Path(run_dir) / "tensorboard", resume_step) if tensorboard else None

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.board.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _summary_writer(folder: Path, resume_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: jsonl only
        return None
    # purge_step drops events after the checkpoint, as the jsonl does
    return SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of metrics.jsonl; a last line cut short (the process killed while writing it) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; the file is damaged (nothing was changed)") from None
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ConfigError(f"{path}:{number}: not a JSON row; the file is damaged (nothing was changed)") from None
    return rows
