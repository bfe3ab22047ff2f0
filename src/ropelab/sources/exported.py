"""Hugging Face folders that ropelab exported with its own modeling code (`ropelab.export.remote_code`),
read back with ropelab's classes.

Such a folder's config.json has model_type "ropelab" and the ModelConfig as a dict under "ropelab";
its weights are the Transformer's, named ``model.<ropelab name>`` (``model.lm_head.weight`` left out
when tied). Reading these needs no transformers and runs none of the Python files beside them (they
are for transformers' trust_remote_code): no flag is needed, and a folder that merely claims to be
one runs no code either, it only fails to load.

  is_ropelab_export(path)   config.json says so (no weights read)
  export_model_config(path) the ModelConfig, validated
  load_export(path)         the Transformer with the folder's weights, fp32, eval mode, on the CPU
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ropelab.config import ConfigError, ModelConfig, from_dict
from ropelab.errors import one_line
from ropelab.model import Transformer

MODEL_TYPE = "ropelab"  # RopelabConfig.model_type in remote_code.MODELING_SOURCE
WEIGHT_PREFIX = "model."  # RopelabForCausalLM.base_model_prefix
_WEIGHTS = "model.safetensors"
_WEIGHTS_INDEX = "model.safetensors.index.json"


def _export_config(path: Path) -> Optional[dict]:
    """config.json of a ropelab export folder, or None for any other path."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE and isinstance(config.get(MODEL_TYPE), dict):
        return config
    return None


def is_ropelab_export(path: str | Path) -> bool:
    return Path(path).is_dir() and _export_config(Path(path)) is not None


def export_model_config(path: str | Path) -> ModelConfig:
    config = _export_config(Path(path))
    if config is None:
        raise ConfigError(f"{path}: not a folder ropelab exported (config.json with model_type {MODEL_TYPE!r})")
    try:
        model_config = from_dict(ModelConfig, dict(config[MODEL_TYPE]), MODEL_TYPE)
        model_config.validate()
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{Path(path) / 'config.json'}: {exc}") from None
    return model_config


def _weight_files(folder: Path) -> list[Path]:
    if (folder / _WEIGHTS).is_file():
        return [folder / _WEIGHTS]
    try:
        index = json.loads((folder / _WEIGHTS_INDEX).read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no {_WEIGHTS} (nor {_WEIGHTS_INDEX})") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{folder / _WEIGHTS_INDEX}: unreadable ({one_line(exc)})") from None


def load_export(path: str | Path) -> Transformer:
    """The Transformer a ropelab export folder holds, fp32, eval mode, on the CPU."""
    from safetensors.torch import load_file

    folder = Path(path)
    model = Transformer(export_model_config(folder), init=False)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            state |= load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - missing, truncated or not safetensors: one line
            raise ConfigError(f"{file}: unreadable ({one_line(exc)})") from None
    state = {name.removeprefix(WEIGHT_PREFIX): tensor for name, tensor in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a weight of another shape
        raise ConfigError(f"{folder}: weights do not match its config.json ({one_line(exc)})") from None
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{folder}: weights do not match its config.json (missing {sorted(set(missing) - tied)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]})")
    return model.float().eval()


__all__ = ["MODEL_TYPE", "is_ropelab_export", "export_model_config", "load_export"]
