"""Data preparation: documents from a source -> token shards, in parallel, resumable.

The main process reads documents in order and hands batches of them to worker processes that
tokenize them (EOS appended, BOS prepended on request) and decide their split; results come back
in submission order, so the output does not depend on the number of workers.

Resuming. After each completed shard, `progress.json` records the shard and the state of the run
at that point: the source position just past the shard's last document and the running totals.
A re-run with the same settings keeps the recorded shards, restarts the source at the earliest
position some split still needs, re-tokenizes from there (documents already in a recorded shard
are counted, not written again) and so produces the same bytes as a run never interrupted.
`manifest.json` is written last; until then the folder is not usable as data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import multiprocessing
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.corpus import in_validation
from ropelab.data.sources import Source, corpus_key
from ropelab.data.tokenizer import ByteTokenizer, Tokenizer, cache_dir
from ropelab.data.tokens import FORMAT, SPLITS, ShardWriter, read_manifest, token_dtype, write_json
from ropelab.errors import WriteFailed, one_line

DEFAULT_SHARD_TOKENS = 2**28
BATCH_CHARS = 1 << 18
BATCH_DOCUMENTS = 1024
PROGRESS = "progress.json"
# a full disk or quota, a read-only or failing file system: one line (WriteFailed), the completed shards kept
_STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


@dataclass
class Encoder:
    """Turns a batch of (key, text) into (token ids, in validation) or None for an empty document."""

    tokenizer: Tokenizer
    val_percent: float
    bos: bool
    encoding_errors: str

    def __call__(self, batch: list[tuple[Optional[str], Optional[str]]]) -> list[Optional[tuple[np.ndarray, bool]]]:
        kept = [(key, text) for key, text in batch if text and text.strip()]
        texts = [text for _, text in kept]
        try:
            encoded = iter(self.tokenizer.encode_batch(texts))
        except UnicodeEncodeError:  # lone surrogates, e.g. from JSON "\ud800" escapes
            if self.encoding_errors == "strict":
                raise ConfigError("a document holds invalid Unicode (lone surrogates); pass --encoding-errors replace") from None
            texts = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
            encoded = iter(self.tokenizer.encode_batch(texts))
        dtype = token_dtype(self.tokenizer.vocab_size)
        head = int(self.bos)
        out = []
        for key, text in batch:
            if not (text and text.strip()):
                out.append(None)
                continue
            body = next(encoded)
            ids = np.empty(head + len(body) + 1, dtype=dtype)
            ids[head:-1] = body
            ids[-1] = self.tokenizer.eos_id
            if head:
                ids[0] = self.tokenizer.bos_id
            out.append((ids, in_validation(text if key is None else key, self.val_percent)))
        return out


_worker_encoder: Optional[Encoder] = None


def _init_worker(encoder: Encoder) -> None:
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_encoder = encoder


def _encode_in_worker(batch):
    return _worker_encoder(batch)


def _batches(documents: Iterator, chars: int = BATCH_CHARS, most: int = BATCH_DOCUMENTS) -> Iterator[list]:
    """Batches of about `chars` characters (at most `most` documents), so workers get even shares."""
    batch, size = [], 0
    for item in documents:
        batch.append(item)
        size += len(item[1] or "")
        if size >= chars or len(batch) == most:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded_batches(encoder: Encoder, batches: Iterator[list], workers: int) -> Iterator[list]:
    """Encoded batches in input order; with workers > 1 at most 2 per worker are in flight."""
    if workers <= 1:
        yield from map(encoder, batches)
        return
    # fork where the platform has it: spawn would re-run a user's unguarded script in every worker
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # a tokenizer that already used its thread pool warns in every forked child unless this is set
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (encoder,))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    with pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _progress(enabled: bool, total: Optional[int]):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("[bold]prepare")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    return Progress(*columns, disable=not enabled, transient=False)


@contextlib.contextmanager
def _locked(folder: Path):
    """One preparation per folder at a time (concurrent runs of the built-in corpus wait here)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _first_difference(a: dict, b: dict) -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key}: {b.get(key)!r} there, {a.get(key)!r} now"
    return ""


def prepare(
    source: Source,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_percent: float = 2.0,
    max_documents: Optional[int] = None,
    max_tokens: Optional[int] = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    bos: bool = False,
    workers: Optional[int] = None,
    progress: bool = True,
) -> dict:
    """Tokenize `source` into shards in `out_dir` (resuming an interrupted run); returns the manifest."""
    if not (0 < val_percent < 50):
        raise ConfigError(f"--val-percent {val_percent}: must be in (0, 50)")
    for name, value in (("--max-documents", max_documents), ("--max-tokens", max_tokens), ("--shard-tokens", shard_tokens)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} {value}: must be > 0")
    if bos and tokenizer.bos_id is None:
        raise ConfigError(f"--bos: tokenizer {tokenizer.name!r} has no BOS token")
    folder = Path(out_dir)
    settings = {
        "source": source.describe(), "tokenizer": tokenizer.name, "tokenizer_fingerprint": tokenizer.fingerprint(),
        "val_percent": val_percent, "max_documents": max_documents, "max_tokens": max_tokens,
        "shard_tokens": shard_tokens, "bos": bos, "encoding_errors": source.encoding_errors,
    }
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {folder}: exists and is not a folder")
    if folder.is_dir() and not any(folder.glob(".lock")) and any(folder.iterdir()):
        raise ConfigError(f"--out {folder}: not empty and holds no preparation; choose a new folder (nothing was written)")
    with _locked(folder):
        if (folder / "manifest.json").is_file():
            manifest = read_manifest(folder)
            if manifest["settings"] != settings:
                raise ConfigError(f"--out {folder}: already holds data prepared with other settings ({_first_difference(settings, manifest['settings'])})")
            return manifest
        state = _load_progress(folder, settings)
        try:
            write_json(folder / PROGRESS, state)
            return _run(source, tokenizer, folder, settings, state, workers or os.cpu_count() or 1, progress)
        except OSError as exc:
            if exc.errno not in _STORAGE_ERRORS:
                raise
            kept = sum(len(records) for records in state["splits"].values())
            raise WriteFailed(f"{folder}: {one_line(exc)}; the {kept} completed shard(s) are kept: "
                              "run the same command again once there is room") from None


def _load_progress(folder: Path, settings: dict) -> dict:
    path = folder / PROGRESS
    if not path.is_file():
        return {"settings": settings, "splits": {split: [] for split in SPLITS}}
    state = json.loads(path.read_text())
    if state["settings"] != settings:
        raise ConfigError(
            f"--out {folder}: holds an unfinished preparation with other settings ({_first_difference(settings, state['settings'])}); "
            "re-run it with its settings, or choose a new folder"
        )
    return state


def _run(source: Source, tokenizer: Tokenizer, folder: Path, settings: dict, state: dict, workers: int, show: bool) -> dict:
    done = state["splits"]
    # Each split resumes after its last recorded shard; the source restarts at the earliest of these.
    resume_at = {split: (records[-1]["source_end"] if records else 0) for split, records in done.items()}
    restart = min(resume_at.values())
    totals = {"documents_read": restart, "documents": 0, "tokens": 0, "empty": 0}
    for records in done.values():
        if records and records[-1]["source_end"] == restart:
            totals = dict(records[-1]["totals"])
    writers = {
        split: ShardWriter(folder, split, token_dtype(tokenizer.vocab_size), settings["shard_tokens"], len(done[split]))
        for split in SPLITS
    }

    def record(split: str, shard: Optional[dict]) -> None:
        if shard is not None:
            done[split].append(shard | {"source_end": totals["documents_read"], "totals": dict(totals)})
            write_json(folder / PROGRESS, state)

    def add(item: Optional[tuple[np.ndarray, bool]]) -> bool:
        """Count one document and write it unless a recorded shard holds it; True at the token limit."""
        position = totals["documents_read"]
        totals["documents_read"] += 1
        if item is None:
            totals["empty"] += 1
            return False
        ids, held_out = item
        split = "validation" if held_out else "train"
        totals["documents"] += 1
        totals["tokens"] += len(ids)
        if position >= resume_at[split]:
            record(split, writers[split].add(ids))
        return settings["max_tokens"] is not None and totals["tokens"] >= settings["max_tokens"]

    encoder = Encoder(tokenizer, settings["val_percent"], settings["bos"], source.encoding_errors)
    limit = settings["max_documents"]
    documents = source.documents(skip=restart)
    if limit is not None:
        documents = (doc for _, doc in zip(range(limit - restart), documents))
    started, tokens_at_start = time.perf_counter(), totals["tokens"]
    batches = encoded_batches(encoder, _batches(documents), workers)
    with _progress(show, limit) as bar, contextlib.closing(batches):
        task = bar.add_task("prepare", total=limit, completed=restart, status="")
        for batch in batches:
            if any(add(item) for item in batch):
                break
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.update(task, completed=totals["documents_read"], status=(
                f"{totals['documents']:,} docs {totals['tokens']:,} tokens  "
                f"{(totals['documents_read'] - restart) / elapsed:,.0f} docs/s {(totals['tokens'] - tokens_at_start) / elapsed:,.0f} tokens/s"))
    for split in SPLITS:
        record(split, writers[split].finish())
    return _write_manifest(folder, tokenizer, settings, state, totals)


def _write_manifest(folder: Path, tokenizer: Tokenizer, settings: dict, state: dict, totals: dict) -> dict:
    splits = {}
    for split, records in state["splits"].items():
        if not records:
            raise ConfigError(
                f"{folder}: the {split} split got no documents ({totals['documents']} read, {totals['empty']} empty); "
                "use more documents or another --val-percent, in a new folder"
            )
        shards = [{k: v for k, v in r.items() if k not in ("source_end", "totals")} for r in records]
        splits[split] = {
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "max_token_id": max(s["max_token_id"] for s in shards), "shards": shards,
        }
    if not isinstance(tokenizer, ByteTokenizer):
        tmp = folder / ".tokenizer.json.partial"
        tokenizer.save(tmp)
        os.replace(tmp, folder / "tokenizer.json")
    manifest = {
        "format": FORMAT, "source": settings["source"], "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name, "documents_read": totals["documents_read"],
        "empty_documents": totals["empty"], "splits": splits, "settings": settings,
    }
    write_json(folder / "manifest.json", manifest)
    (folder / PROGRESS).unlink()
    return manifest


def builtin_token_folder(corpus: str, tokenizer: Tokenizer, val_percent: float) -> Path:
    """The built-in corpus tokenized into the cache (once), keyed by corpus, split and tokenizer."""
    folder = cache_dir() / "tokens" / f"{corpus}-{corpus_key(corpus, val_percent)}-{tokenizer.fingerprint()}-{FORMAT}"
    if not (folder / "manifest.json").is_file():
        prepare(Source(corpus), tokenizer, folder, val_percent=val_percent, progress=False)
    return folder
