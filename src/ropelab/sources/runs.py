"""The run-directory layout, and how a path names a checkpoint.

A run directory (what `ropelab train --out DIR` writes, and what `ropelab import` writes too):
  config.yaml      the resolved configuration (what --resume uses)
  metrics.jsonl    one JSON row per logged step (see `ropelab.train.metrics`)
  checkpoints/     ``step_<N>/`` folders (see `ropelab.train.checkpoint`); phase ends are kept for good
  result.json      written when the run finishes ("steps", final losses, per-phase validation)
  import.json      only in folders written by `ropelab import`: where the weights came from

A path names a checkpoint when it is a run directory (its latest complete checkpoint) or one
``<run>/checkpoints/step_<N>/`` folder. For a multi-phase run, the configuration of a checkpoint is
that of the phase the trainer was in at its step (its RoPE theta, sequence length, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

from ropelab.config import ConfigError, RunConfig, build_run_config, read_yaml
from ropelab.errors import quoted
from ropelab.files import write_atomically
from ropelab.train import checkpoint as ckpt
from ropelab.train.phases import phase_at, resolve_phases

CONFIG = "config.yaml"
RESULT = "result.json"
IMPORT = "import.json"
STEP = re.compile(r"step_(\d+)")
HF_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_run_dir(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def is_checkpoint_folder(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and bool(STEP.fullmatch(path.name)) and path.parent.name == "checkpoints"


def is_hf_folder(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and not is_run_dir(path) and any((path / name).is_file() for name in HF_MARKERS)


def checkpoint_step(folder: Path) -> int:
    return int(STEP.fullmatch(Path(folder).name)[1])


def read_run_config(run_dir: Path) -> RunConfig:
    """The configuration saved in `run_dir/config.yaml` (validated). A `data.tokenizer` naming a file
    inside the folder by a relative path (an imported folder's tokenizer.json) is made absolute, so a
    folder keeps working after it is moved."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {CONFIG}; not a ropelab run directory")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys; the file is damaged")
    try:
        config = build_run_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    inside = Path(run_dir) / config.data.tokenizer
    if not Path(config.data.tokenizer).is_absolute() and inside.is_file():
        config.data.tokenizer = str(inside.resolve())
    return config


def _number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _phases(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("name"), str) and
                                           _count(p.get("end_step")) and _number(p.get("val_loss")) for p in value)


def _record(value: object) -> bool:
    return value is None or isinstance(value, dict)


_NUMBER, _COUNT, _RECORD = ("a number or null", _number), ("a whole number >= 0", _count), ("an object or null", _record)
# result.json's keys (the trainer's TrainResult): what each may hold, and the check of it
RESULT_FIELDS = {"run_dir": ("a string", lambda value: isinstance(value, str)), "steps": _COUNT,
                 "final_train_loss": _NUMBER, "final_val_loss": _NUMBER, "tokens": _COUNT, "wall_time_s": _NUMBER,
                 "tokens_per_s": _NUMBER, "skipped_steps": _COUNT,
                 "phases": ('a list of {"name", "end_step", "val_loss"}', _phases),
                 "init_from": _RECORD, "branch_from": _RECORD, "data_passes": _NUMBER}
RESULT_REQUIRED = ("steps",)


def read_result(run_dir: Path, required: Sequence[str] = RESULT_REQUIRED) -> Optional[dict]:
    """`result.json` of a finished run, or None while it has none; a one-line ConfigError naming the
    file, and the keys, when it is not a JSON object of `RESULT_FIELDS` holding every `required` key."""
    path = Path(run_dir) / RESULT
    if not path.is_file():
        return None
    damaged = f"{path}: the file is damaged:"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{damaged} not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{damaged} not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{damaged} nested too deep to be a result") from None
    if not isinstance(result, dict):
        raise ConfigError(f"{damaged} expected a JSON object with keys {', '.join(RESULT_FIELDS)}")
    missing = [key for key in required if key not in result]
    if missing:
        raise ConfigError(f"{damaged} no {', '.join(map(repr, missing))} key{'s' if len(missing) > 1 else ''}")
    for key, value in result.items():
        if key not in RESULT_FIELDS:
            raise ConfigError(f"{damaged} unknown key {quoted(key)}; allowed: {', '.join(RESULT_FIELDS)}")
        allowed, holds = RESULT_FIELDS[key]
        if not holds(value):
            raise ConfigError(f"{damaged} {key}={quoted(value)}: must be {allowed}")
    return result


def write_result(run_dir: Path, result: dict) -> None:
    write_atomically(Path(run_dir) / RESULT, json.dumps(result, indent=2))


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory holding config.yaml, complete checkpoint folder) for a run or checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file or directory")
    if is_run_dir(p):
        latest = ckpt.latest_checkpoint(p)
        if latest is None:
            raise ConfigError(f"{p}: no complete checkpoint (checkpoints/step_N/ with a {ckpt.MARKER} marker)")
        return p, latest
    if is_checkpoint_folder(p):
        if not (p / ckpt.MARKER).is_file():
            raise ConfigError(f"{p}: incomplete checkpoint (no {ckpt.MARKER} marker); refusing to load it")
        run_dir = p.parent.parent
        if not (run_dir / CONFIG).is_file():
            raise ConfigError(f"{p}: checkpoint without its run's {CONFIG} (expected {run_dir / CONFIG})")
        return run_dir, p
    raise ConfigError(
        f"{p}: not a ropelab run directory (config.yaml + checkpoints/), a checkpoint folder "
        "(<run>/checkpoints/step_N/), a folder written by `ropelab import`, a Hugging Face model folder or a .gguf file"
    )


def checkpoint_config(path: str | Path) -> tuple[RunConfig, Path]:
    """(the configuration the trainer held at the checkpoint, the checkpoint folder): for a
    multi-phase run, that phase's config, with the vocabulary the weights have."""
    run_dir, folder = resolve_checkpoint(path)
    config = read_run_config(run_dir)
    if not ckpt.has_weights(folder):
        raise ConfigError(f"{folder}: no model.safetensors (nor a dcp/ checkpoint)")
    if config.model.vocab_size is None:  # config.yaml written before the vocabulary was known
        config.model.vocab_size = ckpt.weights_vocab(folder)
    if not config.train.phases:
        return config, folder
    phase = phase_at(resolve_phases(config), max(checkpoint_step(folder) - 1, 0)).config
    phase.model.vocab_size = config.model.vocab_size
    return phase, folder


__all__ = [
    "CONFIG", "RESULT", "IMPORT", "is_run_dir", "is_checkpoint_folder", "is_hf_folder", "checkpoint_step",
    "read_run_config", "read_result", "write_result", "resolve_checkpoint", "checkpoint_config",
]
