"""Token storage: a split is a list of memory-mapped shards, each with its own document index.

Folder layout (written by `ropelab data prepare`, and for the built-in corpus on first use):
  manifest.json           format, source, tokenizer name and fingerprint, vocabulary size, special
                          ids, dtype; per split the token and document counts, the largest token
                          id and every shard with the sha256 of its two files
  tokenizer.json          the tokenizer itself (BPE and HF tokenizers), so the folder stands alone
  <split>-NNNNN.bin       token ids, uint16 when the vocabulary fits, else uint32; EOS ends every document
  <split>-NNNNN.idx.npy   int64 offsets: document j of the shard is tokens[idx[j]:idx[j + 1]]
Documents never cross shards. A shard is written under a dotted temporary name and renamed when
complete, and only shards the manifest lists count, so a folder never holds a shard that looks
complete but is not.

Token ids out of range. Each shard's largest id is recorded when it is written; the model's
vocabulary is checked against the manifest before training (`pipeline.check_vocab`), and the bytes
against the record when they are hashed (`verify`: a running max costs ~8% on top of sha256). A
shard damaged where nothing hashes it (data.verify=sizes) is caught by `Shard.check_ids` on every
window read, one max over the window's tokens: a one-line error naming the shard instead of an
IndexError in the embedding. A max over the whole memmap at open was measured instead: 0.03 s per
2^27 uint16 tokens from the page cache but a full read from disk (minutes for hundreds of GB),
which is what data.verify=sizes exists to avoid.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.errors import one_line
from ropelab.files import write_atomically

FORMAT = "ropelab-shards-1"
SPLITS = ("train", "validation")
MANIFEST_KEYS = ("tokenizer", "tokenizer_fingerprint", "vocab_size", "eos_id", "pad_id", "dtype", "splits")


def covering_spans(bases: np.ndarray, start: int, stop: int):
    """(index k, local start, local stop) of the consecutive segments k, segment k covering positions
    [bases[k], bases[k + 1]), that cover positions [start, stop) (cut at bases[-1])."""
    stop = min(stop, int(bases[-1]))
    k = int(np.searchsorted(bases, start, side="right")) - 1
    while start < stop:
        base = int(bases[k])
        end = min(stop, int(bases[k + 1]))
        yield k, start - base, end - base
        start, k = end, k + 1


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def shard_files(folder: Path, name: str) -> tuple[Path, Path]:
    """(token file, index file) of shard `name`, e.g. 'train-00003'."""
    return folder / f"{name}.bin", folder / f"{name}.idx.npy"


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: readers see the old file or the new one."""
    write_atomically(path, json.dumps(data, indent=2))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- reading


@dataclass
class Shard:
    tokens: np.ndarray  # (n,) token ids, memory-mapped
    doc_offsets: np.ndarray  # (d + 1,) int64, first 0, last n
    max_token_id: Optional[int] = None  # the largest id recorded when the shard was written; None: unchecked
    path: Optional[Path] = None  # the token file, for messages

    def check_ids(self, ids: np.ndarray) -> None:
        """ConfigError naming the shard when `ids` (read from it) exceed its recorded largest id."""
        if self.max_token_id is None or not len(ids):
            return
        largest = int(ids.max())
        if largest > self.max_token_id:
            raise ConfigError(
                f"{self.path}: holds token id {largest}, above the largest id written into it ({self.max_token_id}); "
                f"the shard is damaged or was replaced: run `ropelab data verify {self.path.parent}`, or prepare the data again"
            )


class TokenSplit:
    """The shards of one split read as one token stream; documents are numbered across shards."""

    def __init__(self, shards: list[Shard]):
        if not shards:
            raise ValueError("a split needs at least one shard")
        self.shards = shards
        self.token_bases = np.cumsum([0] + [len(s.tokens) for s in shards])
        self.doc_bases = np.cumsum([0] + [len(s.doc_offsets) - 1 for s in shards])

    @property
    def num_tokens(self) -> int:
        return int(self.token_bases[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_bases[-1])

    def _pieces(self, start: int, stop: int):
        """(shard index, local start, local stop) covering stream positions [start, stop)."""
        return covering_spans(self.token_bases, start, stop)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Token ids at stream positions [start, stop) (fewer at the end of the split), as int64."""
        parts = []
        for k, a, b in self._pieces(start, stop):
            parts.append(self.shards[k].tokens[a:b])
            self.shards[k].check_ids(parts[-1])
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For stream positions [start, stop): each token's document number and that document's
        first stream position."""
        docs, firsts = [], []
        for k, a, b in self._pieces(start, stop):
            offsets = self.shards[k].doc_offsets
            local = np.searchsorted(offsets, np.arange(a, b), side="right") - 1
            docs.append(local + self.doc_bases[k])
            firsts.append(np.asarray(offsets[local], dtype=np.int64) + self.token_bases[k])
        if not docs:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(docs), np.concatenate(firsts)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        hint = "; preparation did not finish: re-run the same prepare command to resume" if (Path(folder) / "progress.json").is_file() else ""
        raise ConfigError(f"{folder}: no manifest.json; not a prepared token folder{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{path}: not valid JSON") from None
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {manifest.get('format')!r}, this ropelab reads {FORMAT!r}; prepare the data again")
    missing = [key for key in MANIFEST_KEYS if key not in manifest] + [s for s in SPLITS if s not in manifest.get("splits", {})]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)}; the manifest is damaged, prepare the data again")
    return manifest


def check_sizes(folder: Path, manifest: dict) -> None:
    """Cheap structural check: every listed shard exists with the byte size its counts imply."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            tokens_path, index_path = shard_files(folder, shard["name"])
            for path in (tokens_path, index_path):
                if not path.is_file():
                    raise ConfigError(f"{path}: missing (listed in {folder / 'manifest.json'})")
            if tokens_path.stat().st_size != shard["tokens"] * itemsize:
                raise ConfigError(
                    f"{tokens_path}: {tokens_path.stat().st_size} bytes, the manifest says {shard['tokens']} tokens of {itemsize} bytes"
                )


def open_split(folder: Path, split: str, manifest: Optional[dict] = None) -> TokenSplit:
    manifest = manifest or read_manifest(folder)
    dtype = np.dtype(manifest["dtype"])
    shards = []
    for shard in manifest["splits"][split]["shards"]:
        tokens_path, index_path = shard_files(folder, shard["name"])
        try:
            offsets = np.load(index_path, mmap_mode="r")
        except Exception as exc:  # noqa: BLE001 - a damaged header raises ValueError, SyntaxError, TokenError, EOFError...
            raise ConfigError(f"{index_path}: not a readable document index ({one_line(exc)}); "
                              "the shard is damaged: prepare the data again") from None
        if (offsets.dtype != np.int64 or offsets.shape != (shard["documents"] + 1,)
                or int(offsets[-1]) != shard["tokens"]):
            raise ConfigError(f"{index_path}: does not index {shard['documents']} documents of {shard['tokens']} tokens")
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
        shards.append(Shard(tokens, offsets, shard["max_token_id"], tokens_path))
    return TokenSplit(shards)


# ---------------------------------------------------------------------------- writing


class ShardWriter:
    """Appends documents to the numbered shards of one split. A shard is closed once it holds at
    least `shard_tokens` tokens; its files appear under their final names only when complete."""

    def __init__(self, folder: Path, split: str, dtype, shard_tokens: int, next_index: int = 0):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.index = next_index
        self._file = None

    def _start(self) -> None:
        self.name = f"{self.split}-{self.index:05d}"
        tokens_path, _ = shard_files(self.folder, self.name)
        self._tmp = tokens_path.with_name(f".{tokens_path.name}.partial")
        self._file = open(self._tmp, "wb")
        self._digest = hashlib.sha256()
        self._offsets = [0]
        self._max_id = 0

    def add(self, ids: np.ndarray) -> Optional[dict]:
        """Append one document; returns the shard's record when this document completed it."""
        if self._file is None:
            self._start()
        data = np.ascontiguousarray(ids, dtype=self.dtype)
        self._file.write(data.tobytes())
        self._digest.update(data.tobytes())
        self._offsets.append(self._offsets[-1] + len(data))
        self._max_id = max(self._max_id, int(data.max()))
        return self.finish() if self._offsets[-1] >= self.shard_tokens else None

    def finish(self) -> Optional[dict]:
        """Close the current shard (if it holds anything) and return its record."""
        if self._file is None:
            return None
        self._file.close()
        self._file = None
        tokens_path, index_path = shard_files(self.folder, self.name)
        index_tmp = index_path.with_name(f".{index_path.name}.partial")
        with open(index_tmp, "wb") as f:
            np.save(f, np.asarray(self._offsets, dtype=np.int64))
        record = {
            "name": self.name, "tokens": self._offsets[-1], "documents": len(self._offsets) - 1,
            "max_token_id": self._max_id, "sha256": self._digest.hexdigest(), "index_sha256": sha256_file(index_tmp),
        }
        os.replace(self._tmp, tokens_path)
        os.replace(index_tmp, index_path)
        self.index += 1
        return record
