"""Labels for the probe's checkpoints. Loading goes through `ropelab.sources.load` (runs,
checkpoints, imported folders, Hugging Face folders and hub names, GGUF files)."""

from __future__ import annotations

import re
from pathlib import Path


def checkpoint_labels(sources: list[str]) -> list[str]:
    """Short unique folder-safe names: the run's name, ``run-step_N`` for a checkpoint folder,
    the model's name for a hub id; a repeated name gets -2, -3, ..."""
    labels: list[str] = []
    for source in sources:
        path = Path(str(source).rstrip("/"))
        name = f"{path.parent.parent.name}-{path.name}" if path.parent.name == "checkpoints" else path.name
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "checkpoint"
        label, n = name, 2
        while label in labels:
            label, n = f"{name}-{n}", n + 1
        labels.append(label)
    return labels
