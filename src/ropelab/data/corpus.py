"""Built-in corpus: the running Python's standard-library source, one file per document.

Real, varied text that every fresh machine has without network. Test folders and
site-packages are left out; a stable hash of each file's relative path puts it in the
train or validation split, so the split never depends on file order or machine.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation(relative_path: str, val_percent: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < val_percent * 100


def stdlib_files(split: str, val_percent: float = 2.0) -> list[Path]:
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    root = stdlib_root()
    want_val = split == "validation"
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(relative.parts):
            continue
        if in_validation(relative.as_posix(), val_percent) == want_val:
            files.append(path)
    return files


def stdlib_documents(split: str, val_percent: float = 2.0) -> Iterator[str]:
    """Yield the text of each standard-library file in `split` (undecodable bytes replaced)."""
    for path in stdlib_files(split, val_percent):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text
