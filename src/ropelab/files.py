"""Files and folders that readers see whole.

  write_atomically(path, data)  written under a temporary name in the same folder, then renamed into
                                place, so a crash or a concurrent reader meets the old file or the
                                new one, never half of one
  new_folder(out_dir)           a folder built under a temporary sibling name and renamed into place
                                when complete; refuses an `out_dir` that exists and is not empty
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ropelab.config import ConfigError


def write_atomically(path: Path, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


def refuse_existing(out_dir: str | Path) -> Path:
    """`out_dir` as a Path, or a one-line ConfigError when it exists and is not an empty folder."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    return out


@contextmanager
def new_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir`, renamed to `out_dir` when the block succeeds (removed if not).
    Nothing is ever overwritten: an `out_dir` that is filled meanwhile is refused too."""
    out = refuse_existing(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out}: was filled by someone else meanwhile; the folder stays unwritten")
        os.replace(tmp, out)  # POSIX rename replaces an empty directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
