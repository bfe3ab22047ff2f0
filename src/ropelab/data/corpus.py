"""Built-in corpus `stdlib`: the running Python's standard-library source, one file per document.

Real, varied text that every fresh machine has without network. Test folders and
site-packages are left out; a stable hash of each file's relative path puts it in the
train or validation split, so the split never depends on file order or machine.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation(key: str, val_percent: float) -> bool:
    """Whether the document with this key (a relative path, or a document's text) is held out."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < val_percent * 100


def stdlib_entries() -> list[tuple[str, Path]]:
    """(relative posix path, path) of every standard-library source file used, sorted by path."""
    root = stdlib_root()
    entries = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in EXCLUDED_PARTS]  # site-packages can be huge: never enter it
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                entries.append((path.relative_to(root).as_posix(), path))
    return sorted(entries, key=lambda entry: Path(entry[0]).parts)


def wants_validation(split: str) -> bool:
    """Whether `split` names the validation split ('train' does not; anything else is an error)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return split == "validation"


def stdlib_files(split: str, val_percent: float = 2.0) -> list[Path]:
    want_val = wants_validation(split)
    return [path for relative, path in stdlib_entries() if in_validation(relative, val_percent) == want_val]


def stdlib_text(path: Path) -> str:
    """The `stdlib` document of one standard-library file (undecodable bytes replaced)."""
    return path.read_text(encoding="utf-8", errors="replace")
