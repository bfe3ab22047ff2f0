"""Files that readers see whole: written under a temporary name in the same folder, then renamed
into place, so a crash or a concurrent reader meets the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
