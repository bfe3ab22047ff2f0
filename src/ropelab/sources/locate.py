"""What a model source names, decided from the path or name alone (no weights are read).

  resolve(name) -> Source    one of
    run         a run directory, or a folder written by `ropelab import` (config.yaml + checkpoints/):
                its latest complete checkpoint
    checkpoint  one ``<run>/checkpoints/step_<N>/`` folder
    export      a Hugging Face folder ropelab exported with its own modeling code (`ropelab.sources.exported`):
                read with ropelab's classes, its Python files never run
    hf          a Hugging Face model folder (config.json, no config.yaml), or a hub name ``org/model``
    gguf        a local ``.gguf`` file, or a built-in name such as ``smollm2-135m`` (`ropelab.sources.gguf_files`)

The kind is decided here once; `ropelab.sources.loading` then has one loader per kind. A name that is
spelled like a path but does not exist is a one-line ConfigError, never a hub lookup.
A Source carries `trust_remote_code`: whether transformers may run Python code shipped with an `hf`
model or its tokenizer (False unless the user said so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional

from ropelab.sources.exported import is_ropelab_export
from ropelab.sources.gguf_files import BUILTIN_SOURCES, builtin_gguf, is_gguf
from ropelab.sources.runs import is_checkpoint_folder, is_hf_folder, is_run_dir, resolve_checkpoint

Kind = Literal["run", "checkpoint", "export", "hf", "gguf"]


@dataclass(frozen=True)
class Source:
    name: str  # as the user gave it
    kind: Kind
    location: str  # the resolved folder or file, or the hub name
    run_dir: Optional[Path] = None  # run and checkpoint: the run directory holding config.yaml
    checkpoint: Optional[Path] = None  # run and checkpoint: the complete checkpoint folder
    trust_remote_code: bool = False  # hf: transformers may run code shipped with the model or tokenizer

    @property
    def is_ropelab(self) -> bool:
        return self.kind in ("run", "checkpoint")


def is_local_path(name: str) -> bool:
    """A filesystem path rather than a hub id ("org/name"): exists, or is spelled like a path."""
    return (
        Path(name).exists() or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
        or os.sep != "/" and os.sep in name
    )


def resolve(name: str | Path | Source, trust_remote_code: bool = False) -> Source:
    """The kind and location of a model source; ConfigError (one line) when it names none.
    `trust_remote_code` (or a Source's own) lets transformers run code an `hf` source ships."""
    if isinstance(name, Source):
        return replace(name, trust_remote_code=True) if trust_remote_code else name
    name = str(name)
    if name in BUILTIN_SOURCES:
        return Source(name, "gguf", str(builtin_gguf(name)))
    path = Path(name).expanduser()
    if path.is_file() and is_gguf(path):
        return Source(name, "gguf", str(path.resolve()))
    if is_run_dir(path) or is_checkpoint_folder(path):
        run_dir, folder = resolve_checkpoint(path)
        return Source(name, "run" if is_run_dir(path) else "checkpoint", str(path), run_dir, folder)
    if is_hf_folder(path):  # a folder ropelab exported is one too
        if is_ropelab_export(path):
            return Source(name, "export", str(path))
        return Source(name, "hf", str(path), trust_remote_code=trust_remote_code)
    if is_local_path(name):
        resolve_checkpoint(path)  # raises the one-line error that says what a source can be
    return Source(name, "hf", name, trust_remote_code=trust_remote_code)


__all__ = ["Source", "Kind", "resolve", "is_local_path"]
