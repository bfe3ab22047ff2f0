"""From a run's `DataConfig` to its train and validation loaders (the trainer's one entry point into data/)."""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError, RunConfig
from ropelab.data.loader import PackedLoader
from ropelab.data.tokenizer import load_tokenizer
from ropelab.data.tokens import builtin_token_folder, open_split, read_manifest


def token_folder(config: RunConfig) -> Path:
    """The prepared token folder for the run's corpus (the built-in corpus is tokenized on first use)."""
    data = config.data
    if data.corpus == "stdlib":
        tokenizer = load_tokenizer(data.tokenizer, data.corpus, data.val_percent)
        return builtin_token_folder(data.corpus, tokenizer, data.val_percent)
    folder = Path(data.corpus)
    if not folder.is_dir():
        raise ConfigError(f"data.corpus={data.corpus!r}: neither 'stdlib' nor a prepared token folder")
    return folder


def build_loaders(config: RunConfig) -> tuple[PackedLoader, PackedLoader, dict]:
    """(train loader, validation loader, manifest) for a run."""
    folder = token_folder(config)
    manifest = read_manifest(folder)
    d = config.data
    loader = PackedLoader(open_split(folder, "train"), d.seq_len, config.seed, d.positions)
    val_loader = PackedLoader(open_split(folder, "validation"), d.seq_len, config.seed, d.positions)
    return loader, val_loader, manifest
