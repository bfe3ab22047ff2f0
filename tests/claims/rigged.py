"""Rigged study folders for the claims' tests: a config.yaml, a loss curve and a final validation
loss per run, laid out as the study runner writes them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import yaml

from ropelab.config import build_run_config

CONFIG = dataclasses.asdict(build_run_config({"preset": "tiny-llama"}))


def write_run(study: Path, run_id: str, val_loss: float, losses=None) -> None:
    folder = study / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(CONFIG | {"seed": int(run_id[-1])}))
    losses = np.full(100, val_loss) if losses is None else losses
    rows = [{"step": step + 1, "tokens": 2048 * (step + 1), "loss": float(loss), "tokens_per_s": 1000.0} for step, loss in enumerate(losses)]
    rows[-1]["val_loss"] = val_loss
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / "result.json").write_text(json.dumps({"steps": len(rows), "final_val_loss": val_loss, "tokens": rows[-1]["tokens"]}))


def write_study(folder: Path, means: dict[str, float], spread: float = 0.01) -> Path:
    for variant, mean in means.items():
        for seed in (0, 1):
            write_run(folder, f"{variant}-seed{seed}", mean + (spread if seed else 0.0))
    return folder
