"""Crash-safe checkpoints.

Each checkpoint is a folder ``checkpoints/step_<N>/`` holding ``model.safetensors`` (weights)
and ``state.pt`` (optimizer, step, RNG states, data position). It is written under a
temporary name, marked complete with a ``COMPLETE`` file, then renamed into place, so a
folder without the marker (a crash mid-write) is never loaded.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ropelab.config import ConfigError

MARKER = "COMPLETE"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied weights stored once (safetensors refuses shared storage)."""
    state = {}
    seen = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().contiguous().cpu()
    return state


def load_model_state(model: torch.nn.Module, path: Path) -> None:
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{path}: does not match the model (missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer, extra: dict, keep: int) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(model_state(model), str(tmp / "model.safetensors"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), **extra}, tmp / "state.pt")
    (tmp / MARKER).write_text(str(step))
    if final.exists():  # same step written again after a resume: replace the old copy atomically-ish
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer=None) -> dict:
    if not (path / MARKER).is_file():
        raise ConfigError(f"{path}: incomplete checkpoint (no {MARKER} marker); refusing to load it")
    load_model_state(model, path / "model.safetensors")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return state
