"""From a run's `DataConfig` to its train and validation loaders (the trainer's one entry point into data/).

Opening a token folder checks it against the run before any step: shard sizes always, sha256
checksums per `data.verify`, the tokenizer (by name, else by fingerprint) and the largest token
id against `model.vocab_size`.
"""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError, ModelConfig, RunConfig
from ropelab.data.loader import PackedLoader
from ropelab.data.pieces import ApartPieces
from ropelab.data.prepare import builtin_token_folder
from ropelab.data.sources import BUILTIN_CORPORA
from ropelab.data.tokenizer import load_tokenizer, padded_vocab
from ropelab.data.tokens import SPLITS, check_sizes, open_split, read_manifest
from ropelab.data.verify import verify_checksums


def token_folder(config: RunConfig) -> Path:
    """The prepared token folder for the run's corpus (a built-in corpus is tokenized on first use)."""
    data = config.data
    if data.corpus in BUILTIN_CORPORA:
        tokenizer = load_tokenizer(data.tokenizer, data.corpus, data.val_percent)
        return builtin_token_folder(data.corpus, tokenizer, data.val_percent)
    folder = Path(data.corpus)
    if not folder.is_dir():
        raise ConfigError(f"data.corpus={data.corpus!r}: neither a built-in corpus ({', '.join(BUILTIN_CORPORA)}) nor a prepared token folder")
    return folder


def check_tokenizer(folder: Path, manifest: dict, spec: str) -> None:
    """The run's `data.tokenizer` must be the one the folder was tokenized with."""
    if spec == manifest["tokenizer"]:
        return
    fix = f"set data.tokenizer={manifest['tokenizer']}"
    try:
        fingerprint = load_tokenizer(spec).fingerprint()
    except ConfigError as exc:
        raise ConfigError(f"data.tokenizer={spec!r}: {folder} was tokenized with {manifest['tokenizer']!r} and this one cannot be compared ({exc}); {fix}") from None
    if fingerprint != manifest["tokenizer_fingerprint"]:
        raise ConfigError(
            f"data.tokenizer={spec!r} (fingerprint {fingerprint}) differs from the tokenizer of {folder} "
            f"({manifest['tokenizer']!r}, fingerprint {manifest['tokenizer_fingerprint']}); {fix}"
        )


def fit_vocab_size(model: ModelConfig, manifest: dict) -> None:
    """Set `model.vocab_size` from the token folder's tokenizer (padded) where it is unset; refuse one
    smaller than the tokenizer's."""
    if model.vocab_size is None:
        model.vocab_size = padded_vocab(manifest["vocab_size"])
    elif model.vocab_size < manifest["vocab_size"]:
        raise ConfigError(f"model.vocab_size={model.vocab_size}: smaller than the tokenizer's {manifest['vocab_size']}")


def check_vocab(folder: Path, manifest: dict, vocab_size) -> None:
    largest = max(manifest["splits"][split]["max_token_id"] for split in SPLITS)
    if vocab_size is not None and largest >= vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size}: {folder} holds token ids up to {largest} "
            f"(tokenizer {manifest['tokenizer']!r}, {manifest['vocab_size']} tokens)"
        )


def open_token_folder(folder: Path, verify: str = "once") -> dict:
    """Read and check a token folder's manifest: sizes always, checksums per `verify`."""
    manifest = read_manifest(folder)
    check_sizes(folder, manifest)
    if verify != "sizes":
        verify_checksums(folder, manifest, reuse=verify == "once", remember=verify == "once")
    return manifest


def build_loaders(config: RunConfig) -> tuple[PackedLoader, PackedLoader, dict]:
    """(train loader, validation loader, manifest) for a run."""
    d = config.data
    folder = token_folder(config)
    manifest = open_token_folder(folder, d.verify)
    if d.corpus not in BUILTIN_CORPORA:
        check_tokenizer(folder, manifest, d.tokenizer)
    check_vocab(folder, manifest, config.model.vocab_size)
    pad_id = manifest["pad_id"] if manifest["pad_id"] is not None else manifest["eos_id"]
    loaders = []
    for split in SPLITS:
        tokens = open_split(folder, split, manifest)
        if split == "train" and d.piece_order == "apart":
            tokens = ApartPieces(tokens, d.max_doc_len, gap=d.seq_len)
            manifest = {**manifest, "apart_pieces": {"tokens": tokens.num_tokens, "dropped_tokens": tokens.dropped_tokens}}
        loaders.append(PackedLoader(tokens, d.seq_len, config.seed, d.positions, d.pack, d.mask_boundary_labels, pad_id,
                                    name=f"{folder} ({split})", max_doc_len=d.max_doc_len,
                                    copy_span=d.copy_span if split == "train" else None, copy_share=d.copy_share))
    return loaders[0], loaders[1], manifest
