"""Crash-safe, sharded checkpoints.

A checkpoint is a folder ``checkpoints/step_<N>/``:
  dcp/                 model and optimizer state, torch.distributed.checkpoint format: each rank
                       writes its own shards, and loading reshards to the current world size
  model.safetensors    the full weights in one file (rank 0), for export, evaluation and probing;
                       with `train.full_weights=boundaries` only at phase ends and the last step
                       (`load_weights` reads the model part of dcp/ where it is absent)
  state.pt             step, phase, data position, world size and global batch (rank 0)
  rng_rank<R>.pt       each rank's torch / numpy / python (and CUDA) RNG states
  PHASE                (phase-boundary checkpoints only) the phase's name; never pruned
  COMPLETE             written last
Every rank writes into ``.tmp_step_<N>`` first; rank 0 adds the marker and renames the folder
into place only after all ranks have finished, so a crash mid-write leaves a temporary folder
that is never loaded (and is cleared on the next save). The last ``keep`` checkpoints are kept,
plus every phase-boundary checkpoint (`phase_checkpoints` finds them, e.g. for probing).
On a multi-node job the run directory must be on a file system every node sees.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ropelab.config import ConfigError
from ropelab.train.distributed import DistEnv

MARKER = "COMPLETE"
PHASE_MARKER = "PHASE"
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}"


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


def phase_checkpoints(run_dir: Path) -> dict[str, Path]:
    """Phase name -> the complete checkpoint written at the end of that phase."""
    return {(p / PHASE_MARKER).read_text(): p for p in list_checkpoints(run_dir) if (p / PHASE_MARKER).is_file()}


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


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (tied embeddings)."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name.removeprefix("module."))
        seen.add(id(param))
    return aliases


def _dedup_tied(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tied weights stored once (safetensors refuses shared storage), on the CPU."""
    aliases = _tied_aliases(model)
    return {name: t.detach().contiguous().cpu() for name, t in state.items() if name not in aliases}


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return _dedup_tied(model.state_dict(), model)


WEIGHTS = "model.safetensors"


def has_weights(folder: Path) -> bool:
    return (Path(folder) / WEIGHTS).is_file() or (Path(folder) / "dcp" / ".metadata").is_file()


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """A checkpoint's (or imported folder's) weights into `model` in this process: model.safetensors
    when it was written, else the model part of the sharded dcp/ state, gathered."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        load_model_state(model, folder / WEIGHTS)
    elif has_weights(folder):
        _load_model_shards(model, folder)
    else:
        raise ConfigError(f"{folder}: no {WEIGHTS} and no dcp/ checkpoint")


def _load_shards(path: Path, state: dict) -> None:
    """Fill `state` ({"model": ...} and optionally {"optim": ...}) from dcp/, resharded to this world."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))


def _load_model_shards(model: torch.nn.Module, path: Path) -> None:
    state = {"model": model.state_dict()}
    _load_shards(path, state)
    model.load_state_dict(state["model"])


def weights_vocab(folder: Path) -> int:
    """Rows of the token embedding stored in a checkpoint folder."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            return int(f.get_slice("embed.weight").get_shape()[0])
    from torch.distributed.checkpoint import FileSystemReader

    return int(FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata["model.embed.weight"].size[0])


def load_model_state(model: torch.nn.Module, path: Path) -> None:
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{path}: does not match the model (missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on the CPU (a collective under FSDP: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def clear_partial(run_dir: Path) -> None:
    """Remove temporary folders left by a crash in the middle of a save."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for tmp in root.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer, extra: dict, keep: int,
                    env: Optional[DistEnv] = None, phase_end: Optional[str] = None, full_weights: bool = True) -> Path:
    """Collective: every rank calls it with its own (possibly sharded) model and optimizer.
    `phase_end` names the phase this checkpoint completes (kept for good); `full_weights` adds
    model.safetensors (under FSDP a gather of every weight onto rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    env = env or DistEnv()
    root = checkpoint_dir(run_dir)
    final = step_dir(run_dir, step)
    tmp = root / f".tmp_step_{step:08d}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    env.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    weights = _full_weights(model) if full_weights else None
    torch.save(rng_state(), tmp / f"rng_rank{env.rank}.pt")
    if env.is_main and weights is not None:
        save_file(_dedup_tied(weights, model), str(tmp / WEIGHTS))
    if env.is_main:
        torch.save({"step": step, "world": env.world, **extra}, tmp / "state.pt")
    env.barrier()
    if env.is_main:
        if phase_end is not None:
            (tmp / PHASE_MARKER).write_text(phase_end)
        (tmp / MARKER).write_text(str(step))
        if final.exists():  # the same step written again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            if not (old / PHASE_MARKER).is_file():
                shutil.rmtree(old, ignore_errors=True)
    env.barrier()
    return final


def read_state(path: Path) -> dict:
    """A complete checkpoint's bookkeeping (step, data position, world size, global batch)."""
    if not (Path(path) / MARKER).is_file():
        raise ConfigError(f"{path}: incomplete checkpoint (no {MARKER} marker); refusing to load it")
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer=None, env: Optional[DistEnv] = None) -> dict:
    """Collective: restore model and optimizer (resharded to this world size) and this rank's RNG."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    env = env or DistEnv()
    state = read_state(path)
    if optimizer is None:
        _load_model_shards(model, path)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        to_load = {"model": model_sd, "optim": optim_sd}
        _load_shards(path, to_load)
        set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    rng_file = Path(path) / f"rng_rank{env.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    return state
