"""Rigged study folders for the claims' tests: a config.yaml, a loss curve and a final validation
loss per run, laid out as the study runner writes them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from ropelab.claims.paths import CLAIMS_CONFIGS
from ropelab.config import build_run_config
from ropelab.study.grid import expand, load_study

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


def write_frontier_study(folder: Path, shifts: dict, params=(50_000, 100_000), budgets=(2.5, 5.0, 10.0, 20.0),
                         spread: float = 0.01, corpus_tokens: Optional[int] = None) -> Path:
    """A finished frontier study: a cooldown run per variant, size, budget and seed (0 and 1), whose final
    validation loss is a common falling curve plus the variant's shift, plus `spread` at seed 1. A
    shift is a number, or a function of the budget's doubling (0 for the smallest budget, 1, 2, ...).
    With `corpus_tokens`, each result records its passes over a training split of that many tokens."""
    record = {}
    for variant, shift in shifts.items():
        for size in params:
            for doubling, budget in enumerate(budgets):
                tokens = int(budget * size)
                offset = shift(doubling) if callable(shift) else shift
                for seed in (0, 1):
                    run_id = f"{variant}-p{size}-seed{seed}-{budget:g}tpp"
                    record[run_id] = {"role": "cooldown", "group": f"{variant}-p{size}-seed{seed}", "variant": variant,
                                      "seed": seed, "params": size, "budget": budget, "tokens": tokens,
                                      "unit": "tokens_per_param"}
                    loss = 2.0 + 30.0 * tokens ** -0.3 + offset + (spread if seed else 0.0)
                    run = folder / "runs" / run_id
                    run.mkdir(parents=True)
                    passes = {"data_passes": tokens / corpus_tokens} if corpus_tokens else {}
                    (run / "result.json").write_text(json.dumps({"steps": 10, "final_val_loss": loss, "tokens": tokens,
                                                                 **passes}))
    (folder / "study.yaml").write_text(yaml.safe_dump({"name": folder.name, "runs": {}, "frontier": record}))
    return folder


def shipped_runs(study: Path, stem: str):
    """Each run of the shipped claims study `stem` with its folder and config.yaml written, as
    (run, folder, variant, shift): seed N shifts the made-up figures by 0.01 N."""
    for run in expand(load_study(CLAIMS_CONFIGS / f"{stem}.yaml")):
        folder = study / "runs" / run.id
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(run.config.to_yaml())
        yield run, folder, run.id.rsplit("-seed", 1)[0], 0.01 * run.config.seed
