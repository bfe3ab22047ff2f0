"""Checksums of a token folder: every shard file and the saved tokenizer against the manifest.

Hashing reads every byte, and each token file's largest id is taken from the same blocks and
checked against the one recorded when the shard was written, so an out-of-range id is named as such.

Hashing hundreds of gigabytes takes minutes, so training (``data.verify=once``) may skip it: with
``reuse=True`` a check recorded earlier (``remember=True``, keyed by the folder's path and manifest)
stands while every file keeps its size, inode, modification time and change time. The change time
is in the record because a writer can put the modification time back (``os.utime``) but not the
change time. `ropelab data verify` never reuses a record: it always hashes, then records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.tokenizer import cache_dir, tokenizer_file_fingerprint
from ropelab.data.tokens import SPLITS, shard_files, write_json

_BLOCK = 1 << 22  # a multiple of every token size


def _expected(folder: Path, manifest: dict) -> dict[Path, tuple[str, int | None]]:
    """{file: (sha256, largest token id or None for an index file)} for every shard file listed."""
    out = {}
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            tokens_path, index_path = shard_files(folder, shard["name"])
            out[tokens_path] = (shard["sha256"], shard["max_token_id"])
            out[index_path] = (shard["index_sha256"], None)
    return out


def _stamp(paths) -> dict:
    stats = {str(p): p.stat() for p in paths}
    return {path: [s.st_size, s.st_ino, s.st_mtime_ns, s.st_ctime_ns] for path, s in stats.items()}


def _record_path(folder: Path, manifest: dict) -> Path:
    key = hashlib.sha256(f"{folder.resolve()}\n{json.dumps(manifest, sort_keys=True)}".encode()).hexdigest()[:20]
    return cache_dir() / "verified" / f"{key}.json"


def _recorded(record: Path):
    """The stamp an earlier check recorded, or None (none, or a damaged record: hash again)."""
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def sha256_and_max(path: Path, dtype) -> tuple[str, int]:
    """(sha256 of the file, its largest value read as `dtype`; -1 when not asked for) in one read."""
    digest, largest = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            if dtype is not None:
                largest = max(largest, int(np.frombuffer(block, dtype=dtype).max()))
    return digest.hexdigest(), largest


def verify_checksums(folder: Path, manifest: dict, reuse: bool = False, remember: bool = False, progress: bool = False) -> None:
    """Raise ConfigError naming the first file whose bytes differ from the manifest's record: an id
    above the shard's recorded largest, or another sha256. `reuse`: skip the hashing when an earlier
    check was recorded for these very files; `remember`: record this one."""
    folder = Path(folder)
    expected = _expected(folder, manifest)
    tokenizer_path = folder / "tokenizer.json"
    files = list(expected) + ([tokenizer_path] if tokenizer_path.is_file() else [])
    record = _record_path(folder, manifest)
    if reuse and _recorded(record) == _stamp(files):
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    dtype = np.dtype(manifest["dtype"])
    with Progress(TextColumn("[bold]verify"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), disable=not progress) as bar:
        task = bar.add_task("verify", total=sum(p.stat().st_size for p in expected))
        for path, (digest, recorded_max) in expected.items():
            actual, largest = sha256_and_max(path, None if recorded_max is None else dtype)
            if recorded_max is not None and largest > recorded_max:
                raise ConfigError(
                    f"{path}: holds token id {largest}, above the largest id written into it ({recorded_max}; "
                    f"the tokenizer has {manifest['vocab_size']}); the shard is damaged or was replaced: prepare the data again"
                )
            if actual != digest:
                raise ConfigError(f"{path}: sha256 differs from {folder / 'manifest.json'}; the shard is damaged or was replaced")
            bar.advance(task, path.stat().st_size)
    if tokenizer_path.is_file() and tokenizer_file_fingerprint(tokenizer_path) != manifest["tokenizer_fingerprint"]:
        raise ConfigError(f"{tokenizer_path}: tokenizer fingerprint differs from {folder / 'manifest.json'} ({manifest['tokenizer_fingerprint']})")
    if remember:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json(record, _stamp(files))
