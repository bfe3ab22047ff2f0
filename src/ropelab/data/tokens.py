"""Token storage: one flat token array per split plus document offsets, memory-mapped.

Folder layout (also what data preparation writes):
  manifest.json                    tokenizer name and fingerprint, vocab size, dtype, counts
  <split>.tokens.bin               token ids, EOS after every document, uint16 or uint32
  <split>.docs.npy                 int64 offsets: document d is tokens[docs[d]:docs[d+1]]
Files are written under a temporary name and renamed, so a folder never holds a
split that looks complete but is not.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.tokenizer import Tokenizer, cache_dir


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


@dataclass
class TokenSplit:
    tokens: np.ndarray  # (N,) memory-mapped token ids
    doc_offsets: np.ndarray  # (D + 1,) int64

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def write_split(folder: Path, split: str, tokenizer: Tokenizer, documents: Iterable[str], batch_size: int = 256) -> dict:
    """Tokenize `documents` (EOS appended to each) into `folder`; returns the split's counts."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp_tokens = folder / f".{split}.tokens.bin.tmp{os.getpid()}"
    offsets = [0]
    batch: list[str] = []

    def flush(out) -> None:
        for ids in tokenizer.encode_batch(batch):
            ids.append(tokenizer.eos_id)
            np.asarray(ids, dtype=dtype).tofile(out)
            offsets.append(offsets[-1] + len(ids))
        batch.clear()

    with open(tmp_tokens, "wb") as out:
        for text in documents:
            batch.append(text)
            if len(batch) >= batch_size:
                flush(out)
        if batch:
            flush(out)
    if len(offsets) == 1:
        tmp_tokens.unlink()
        raise ConfigError(f"{folder}: split {split!r} has no documents")
    tmp_docs = folder / f".{split}.docs.tmp{os.getpid()}.npy"
    np.save(tmp_docs, np.asarray(offsets, dtype=np.int64))
    os.replace(tmp_tokens, folder / f"{split}.tokens.bin")
    os.replace(tmp_docs, folder / f"{split}.docs.npy")
    return {"tokens": offsets[-1], "documents": len(offsets) - 1}


def write_manifest(folder: Path, tokenizer: Tokenizer, source: str, splits: dict) -> None:
    manifest = {
        "source": source,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
        "splits": splits,
    }
    tmp = folder / f".manifest.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, folder / "manifest.json")


def read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no manifest.json; not a prepared token folder")
    return json.loads(path.read_text())


def open_split(folder: Path, split: str) -> TokenSplit:
    manifest = read_manifest(folder)
    tokens_path = folder / f"{split}.tokens.bin"
    docs_path = folder / f"{split}.docs.npy"
    if not tokens_path.is_file() or not docs_path.is_file():
        raise ConfigError(f"{folder}: split {split!r} missing ({tokens_path.name} / {docs_path.name})")
    tokens = np.memmap(tokens_path, dtype=np.dtype(manifest["dtype"]), mode="r")
    offsets = np.load(docs_path)
    if int(offsets[-1]) != tokens.shape[0]:
        raise ConfigError(f"{tokens_path}: holds {tokens.shape[0]} tokens but its index says {int(offsets[-1])}")
    return TokenSplit(tokens, offsets)


def builtin_token_folder(corpus: str, tokenizer: Tokenizer, val_percent: float) -> Path:
    """Tokenized built-in corpus, cached by corpus, split and tokenizer fingerprint."""
    from ropelab.data.sources import corpus_documents, corpus_key

    folder = cache_dir() / "tokens" / f"{corpus}-{corpus_key(corpus, val_percent)}-{tokenizer.fingerprint()}"
    if not (folder / "manifest.json").is_file():
        splits = {
            split: write_split(folder, split, tokenizer, corpus_documents(corpus, split, val_percent))
            for split in ("train", "validation")
        }
        write_manifest(folder, tokenizer, corpus, splits)
    return folder
