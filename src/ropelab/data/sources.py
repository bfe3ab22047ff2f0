"""Named document sources: the built-in `stdlib` corpus, or a prepared token folder."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Iterator

from ropelab.config import ConfigError
from ropelab.data.corpus import stdlib_documents, stdlib_root


def corpus_key(corpus: str, val_percent: float) -> str:
    """Short stable key for caches derived from a corpus and its split."""
    if corpus == "stdlib":
        ident = f"stdlib:{sys.version_info.major}.{sys.version_info.minor}:{stdlib_root()}:{val_percent}"
    else:
        ident = f"{Path(corpus).resolve()}:{val_percent}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def corpus_documents(corpus: str, split: str, val_percent: float = 2.0) -> Iterator[str]:
    if corpus == "stdlib":
        return stdlib_documents(split, val_percent)
    raise ConfigError(f"data.corpus={corpus!r}: text documents are only built in for 'stdlib'; prepare other sources into a token folder")
