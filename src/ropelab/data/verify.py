"""Checksums of a token folder: every shard file and the saved tokenizer against the manifest.

Hashing hundreds of gigabytes takes minutes, so with ``remember=True`` a successful check is
recorded in the cache, keyed by the folder's path and manifest, together with every file's size
and modification time; later opens skip the hashing until one of them changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ropelab.config import ConfigError
from ropelab.data.tokenizer import cache_dir, tokenizer_file_fingerprint
from ropelab.data.tokens import SPLITS, sha256_file, shard_files, write_json


def _expected(folder: Path, manifest: dict) -> dict[Path, str]:
    """{file: sha256} for every shard file the manifest lists."""
    out = {}
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            tokens_path, index_path = shard_files(folder, shard["name"])
            out[tokens_path] = shard["sha256"]
            out[index_path] = shard["index_sha256"]
    return out


def _stamp(paths) -> dict:
    return {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in paths}


def _record_path(folder: Path, manifest: dict) -> Path:
    key = hashlib.sha256(f"{folder.resolve()}\n{json.dumps(manifest, sort_keys=True)}".encode()).hexdigest()[:20]
    return cache_dir() / "verified" / f"{key}.json"


def verify_checksums(folder: Path, manifest: dict, remember: bool = False, progress: bool = False) -> None:
    """Raise ConfigError naming the first file whose checksum differs from the manifest's."""
    folder = Path(folder)
    expected = _expected(folder, manifest)
    tokenizer_path = folder / "tokenizer.json"
    files = list(expected) + ([tokenizer_path] if tokenizer_path.is_file() else [])
    record = _record_path(folder, manifest)
    if remember and record.is_file() and json.loads(record.read_text()) == _stamp(files):
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn("[bold]verify"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), disable=not progress) as bar:
        task = bar.add_task("verify", total=sum(p.stat().st_size for p in expected))
        for path, digest in expected.items():
            if sha256_file(path) != digest:
                raise ConfigError(f"{path}: sha256 differs from {folder / 'manifest.json'}; the shard is damaged or was replaced")
            bar.advance(task, path.stat().st_size)
    if tokenizer_path.is_file() and tokenizer_file_fingerprint(tokenizer_path) != manifest["tokenizer_fingerprint"]:
        raise ConfigError(f"{tokenizer_path}: tokenizer fingerprint differs from {folder / 'manifest.json'} ({manifest['tokenizer_fingerprint']})")
    if remember:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json(record, _stamp(files))
