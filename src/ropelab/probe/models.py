"""Checkpoints for the probe: ropelab runs, checkpoint folders, imported folders, and Hugging Face
Llama/GPT-NeoX/Qwen models (a local folder or a hub name), which are converted with
`ropelab.evaluate.interchange.import_hf` into a scratch folder, loaded, and the copy deleted.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from ropelab.config import ConfigError, RunConfig
from ropelab.evaluate.interchange import import_hf, load_model
from ropelab.model import Transformer

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")


def is_hf_source(source: str) -> bool:
    """A Hugging Face model folder (config.json, no ropelab config.yaml) or a hub name (org/name)
    that is not a local path."""
    path = Path(source)
    if path.exists():
        return path.is_dir() and (path / "config.json").is_file() and not (path / "config.yaml").is_file()
    return bool(_HUB_NAME.fullmatch(source)) and not source.startswith(".")


def load_probe_model(source: str | Path) -> tuple[Transformer, RunConfig]:
    """(model in fp32 eval mode on the CPU, its run config) for any checkpoint the probe accepts."""
    source = str(source)
    if not is_hf_source(source):
        return load_model(source)
    with tempfile.TemporaryDirectory(prefix="ropelab-probe-import-") as scratch:
        folder = Path(scratch) / "model"
        try:
            import_hf(source, folder)
        except ConfigError as exc:
            if Path(source).exists():
                raise
            raise ConfigError(f"{source}: no such folder, and not loadable as a Hugging Face hub model ({exc})") from None
        return load_model(folder)


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
