"""Crash-safe, sharded checkpoints.

A checkpoint is a folder ``checkpoints/step_<N>/``:
  dcp/                 model and optimizer state, torch.distributed.checkpoint format: each rank
                       writes its own shards, and loading reshards to the current world size
  model.safetensors    the full weights in one file (rank 0), for export, evaluation and probing;
                       with `train.full_weights=boundaries` only at phase ends and the last step
                       (`load_weights` reads the model part of dcp/ where it is absent)
  state.pt             step, phase, data position, world size and global batch (rank 0)
  rng_rank<R>.pt       each rank's torch / numpy / python (and CUDA) RNG states, as tensors and lists
  PHASE                (phase-boundary checkpoints only) the phase's name; never pruned
  KEEP                 (`train.checkpoint_steps` only: points other runs branch from) never pruned
  CHECKSUMS.json       size and checksum of every file above (`ropelab.train.integrity`)
  COMPLETE             written last; names CHECKSUMS.json with its CRC-32
Every rank writes into ``.tmp_step_<N>`` first; rank 0 adds the marker and renames the folder
into place only after all ranks have finished, so a crash mid-write leaves a temporary folder
that is never loaded (and is cleared on the next save). The last ``keep`` checkpoints are kept,
plus every phase-boundary checkpoint (`phase_checkpoints` finds them, e.g. for probing), every
one marked KEEP, the `protect`ed ones the trainer names, and the newest one whose files have their recorded sizes.
On a multi-node job the run directory must be on a file system every node sees.

Trust. `read_state`, `load_checkpoint`, `load_weights` and `weights_vocab` verify the files they
read against the manifest first (`verify="always"`: sizes and checksums; "sizes": sizes only;
"never"), so a bit flip or a truncated file is one line, `DamagedCheckpoint`, naming the
checkpoint and the file, before any parser sees it. `latest_intact_checkpoint` finds the newest
checkpoint that verifies, and the damaged newer ones. Checkpoints written before manifests load
unverified: their weights are only checked for being finite, and a warning line says so. Nothing
loaded runs code: tensors and plain data only (`ropelab.train.safe_pickle`).
"""

from __future__ import annotations

import io
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ropelab.config import ConfigError
from ropelab.errors import one_line
from ropelab.files import as_os_error
from ropelab.train import integrity
from ropelab.train.distributed import DistEnv
from ropelab.train.integrity import MANIFEST, MARKER, DamagedCheckpoint, verify_checkpoint  # noqa: F401 (also for callers)
from ropelab.train.safe_pickle import UnsafeCheckpoint, dcp_load, load_plain, read_dcp_metadata  # noqa: F401 (also for callers)

PHASE_MARKER = "PHASE"
KEEP_MARKER = "KEEP"  # a checkpoint kept for good (`train.checkpoint_steps`: a point runs branch from)
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
    """This process's RNG states as tensors, numbers and strings (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()` (or the numpy-array form of checkpoints written before it)."""
    torch.set_rng_state(state["torch"])
    numpy, python = state["numpy"], state["python"]
    if isinstance(numpy, dict):
        numpy = (numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                 numpy["cached_gaussian"])
    np.random.set_state(numpy)
    if isinstance(python, dict):
        python = (python["version"], tuple(python["state"].tolist()), python["gauss_next"])
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value, where: str = "extra"):
    """`value` with numpy scalars as Python numbers; TypeError for anything weights_only cannot load."""
    if isinstance(value, np.generic):
        return value.item()
    if value is None or type(value) in (bool, int, float, str, bytes) or isinstance(value, torch.Tensor):
        return value
    if type(value) in (list, tuple):
        return type(value)(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"checkpoint state {where}: a {type(value).__name__}; only tensors and plain data are saved")


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


def load_weights(model: torch.nn.Module, folder: Path, verify: str = "always") -> None:
    """A checkpoint's (or imported folder's) weights into `model` in this process: model.safetensors
    when it was written, else the model part of the sharded dcp/ state, gathered."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        verified, file = verify_checkpoint(folder, verify, files=[WEIGHTS]), WEIGHTS
        load_model_state(model, folder / WEIGHTS)
    elif has_weights(folder):
        verified, file = verify_checkpoint(folder, verify, files=["dcp/*"]), "dcp"
        _load_model_shards(model, folder)
    else:
        raise ConfigError(f"{folder}: no {WEIGHTS} and no dcp/ checkpoint")
    if not verified and verify != "never":
        _check_unverified(model, folder, file)


def _non_finite_tensor(model: torch.nn.Module) -> Optional[str]:
    """The name of the first tensor of `model` (of this rank's part of a sharded one) holding NaN or an infinity."""
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        if local.is_floating_point() and not torch.isfinite(local).all():
            return name.removeprefix("module.")
    return None


def _check_unverified(model: torch.nn.Module, folder: Path, file: str, env: Optional[DistEnv] = None) -> None:
    """What can be checked of weights loaded from a checkpoint written before checksums: a one-line
    DamagedCheckpoint naming a tensor that holds NaN or an infinity, else one line of warning. Collective
    with an active `env`."""
    env = env or DistEnv()
    bad = _non_finite_tensor(model)
    if env.active and not env.all_true(bad is None, next(model.parameters()).device) and bad is None:
        bad = "of another rank"
    if bad is not None:
        raise DamagedCheckpoint(folder, file, f"tensor {bad} holds NaN or infinite values; unverified (no checksums)")
    if env.is_main:
        print(f"ropelab: warning: {folder}: unverified (no checksums): written before checkpoints had them; its "
              "weights were checked only for being finite", file=sys.stderr)


def _load_shards(path: Path, state: dict) -> None:
    """Fill `state` ({"model": ...} and optionally {"optim": ...}) from dcp/, resharded to this world."""
    dcp_load(state, Path(path) / "dcp")


def _load_model_shards(model: torch.nn.Module, path: Path) -> None:
    state = {"model": model.state_dict()}
    _load_shards(path, state)
    model.load_state_dict(state["model"])


def weights_vocab(folder: Path, verify: str = "always") -> int:
    """Rows of the token embedding stored in a checkpoint folder."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        verify_checkpoint(folder, verify, files=[WEIGHTS])
        try:
            with safe_open(str(folder / WEIGHTS), framework="pt") as f:
                return int(f.get_slice("embed.weight").get_shape()[0])
        except Exception as exc:
            raise DamagedCheckpoint(folder, WEIGHTS, f"unreadable ({one_line(exc)})") from None
    verify_checkpoint(folder, verify, files=["dcp/.metadata"])
    return int(read_dcp_metadata(folder / "dcp").state_dict_metadata["model.embed.weight"].size[0])


def load_model_state(model: torch.nn.Module, path: Path) -> None:
    try:
        state = load_file(str(path))
    except Exception as exc:  # caught by the checksum first when the checkpoint has one
        raise DamagedCheckpoint(Path(path).parent, Path(path).name, f"unreadable ({one_line(exc)})") from None
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise ConfigError(f"{path}: tensor {name} has shape {list(tensor.shape)}, but the checkpoint's config.yaml "
                              f"makes it {list(expected[name].shape)}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{path}: does not match the model (missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on the CPU (a collective under FSDP: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_small(obj, path: Path) -> None:
    """torch.save through memory, then one Python write: a failed write (a full disk) is an OSError
    with its errno, where torch's own file writer raises a RuntimeError without one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    Path(path).write_bytes(buffer.getbuffer())


def clear_partial(run_dir: Path) -> None:
    """Remove temporary folders left by a crash in the middle of a save."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for tmp in root.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer, extra: dict, keep: int,
                    env: Optional[DistEnv] = None, phase_end: Optional[str] = None, full_weights: bool = True,
                    protect: Iterable[Path] = (), keep_for_good: bool = False) -> Path:
    """Collective: every rank calls it with its own (possibly sharded) model and optimizer.
    `phase_end` names the phase this checkpoint completes (kept for good); `full_weights` adds
    model.safetensors (under FSDP a gather of every weight onto rank 0); `protect` names checkpoints
    pruning must keep (the trainer's last known-good one); `keep_for_good` marks it to be kept like a
    phase boundary. `extra` is plain data (numbers, strings,
    lists, dicts, tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    env = env or DistEnv()
    extra = _plain(dict(extra))
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
    with warnings.catch_warnings(), as_os_error(tmp):
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    weights = _full_weights(model) if full_weights else None
    _save_small(rng_state(), tmp / f"rng_rank{env.rank}.pt")
    if env.is_main and weights is not None:
        with as_os_error(tmp):
            save_file(_dedup_tied(weights, model), str(tmp / WEIGHTS))
    if env.is_main:
        _save_small({"step": step, "world": env.world, **extra}, tmp / "state.pt")
    known = _gather_checksums(tmp, env)  # also the barrier: every rank's files are on disk
    if env.is_main:
        if phase_end is not None:
            (tmp / PHASE_MARKER).write_text(phase_end)
        if keep_for_good:
            (tmp / KEEP_MARKER).write_text(f"{step}\n")
        manifest_line = integrity.write_manifest(tmp, known)
        (tmp / MARKER).write_text(f"{step}\n{manifest_line}\n")
        if final.exists():  # the same step written again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(run_dir, keep, protect)
    env.barrier()
    return final


def _gather_checksums(tmp: Path, env: DistEnv) -> dict[str, dict]:
    """On rank 0, the manifest entries of the files each rank wrote itself (its rng file and dcp
    shards), checksummed by that rank; {} elsewhere."""
    own = [f"rng_rank{env.rank}.pt", *(f"dcp/{p.name}" for p in sorted((tmp / "dcp").glob(f"__{env.rank}_*")))]
    mine = integrity.entries(tmp, own)
    if not env.active:
        return mine
    import torch.distributed as dist

    gathered = [None] * env.world if env.is_main else None
    dist.gather_object(mine, gathered, dst=0)
    return {name: entry for part in gathered or [] for name, entry in part.items()}


def prune(run_dir: Path, keep: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete complete checkpoints older than the last `keep`, except phase-boundary ones, those in
    `protect`, and the newest one whose files all have their recorded sizes (a stat, no read:
    checksums are checked when a checkpoint is loaded). Returns the deleted folders."""
    found = list_checkpoints(run_dir)
    if keep < 1 or len(found) <= keep:
        return []
    kept = {p.resolve() for p in protect} | {p.resolve() for p in found[-keep:]}
    for folder in reversed(found):
        try:
            verify_checkpoint(folder, "sizes")
        except DamagedCheckpoint:
            continue
        kept.add(folder.resolve())
        break
    deleted = [old for old in found if old.resolve() not in kept and not kept_for_good(old)]
    for old in deleted:
        shutil.rmtree(old, ignore_errors=True)
    return deleted


def kept_for_good(folder: Path) -> bool:
    """Whether `prune` never deletes this checkpoint (`train.checkpoint_steps`, a phase's end)."""
    return (folder / PHASE_MARKER).is_file() or (folder / KEEP_MARKER).is_file()


def latest_intact_checkpoint(run_dir: Path, mode: str = "always",
                             env: Optional[DistEnv] = None) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(the newest complete checkpoint that verifies, or None; [(damaged newer checkpoint, "file:
    reason")], newest first). Checkpoints without a manifest count as intact. Collective with an
    active `env` (rank 0's listing is used by all). After it, load with verify="sizes"."""
    env = env or DistEnv()
    found = env.broadcast_object(list_checkpoints(run_dir) if env.is_main else None)
    damaged = []
    for folder in reversed(found):
        try:
            verify_checkpoint(folder, mode, env=env)
        except DamagedCheckpoint as exc:
            damaged.append((folder, exc.detail))
            continue
        return folder, damaged
    return None, damaged


def read_state(path: Path, verify: str = "always") -> dict:
    """A complete checkpoint's bookkeeping (step, data position, world size, global batch)."""
    if not (Path(path) / MARKER).is_file():
        raise ConfigError(f"{path}: incomplete checkpoint (no {MARKER} marker); refusing to load it")
    verify_checkpoint(path, verify, files=["state.pt"])
    state = load_plain(Path(path) / "state.pt")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DamagedCheckpoint(Path(path), "state.pt", "unreadable (no step in it)")
    return state


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer=None, env: Optional[DistEnv] = None,
                    verify: str = "always") -> dict:
    """Collective: restore model and optimizer (resharded to this world size) and this rank's RNG,
    after verifying (collectively) the files that takes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    env = env or DistEnv()
    if not (Path(path) / MARKER).is_file():
        raise ConfigError(f"{path}: incomplete checkpoint (no {MARKER} marker); refusing to load it")
    verified = verify_checkpoint(path, verify, files=["state.pt", "dcp/*", "rng_rank*.pt"], env=env)
    state = read_state(path, verify="never")
    if optimizer is None:
        _load_model_shards(model, path)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        to_load = {"model": model_sd, "optim": optim_sd}
        _load_shards(path, to_load)
        set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    if not verified and verify != "never":
        _check_unverified(model, path, "dcp", env)
    rng_file = Path(path) / f"rng_rank{env.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than wrote the checkpoint
        set_rng_state(load_plain(rng_file, legacy_numpy=True))
    return state
