"""Data preparation: documents from a source -> token shards, in parallel, resumable.

The main process reads documents in order and hands batches of them to worker processes that
tokenize them (EOS appended, BOS prepended on request) and decide their split; results come back
in submission order, so the output does not depend on the number of workers (`ropelab.data.encoding`).

Resuming. After each completed shard, `progress.json` records the shard and the state of the run
at that point: the source position just past the shard's last document and the running totals.
A re-run with the same settings keeps the recorded shards, restarts the source at the earliest
position some split still needs, re-tokenizes from there (documents already in a recorded shard
are counted, not written again) and so produces the same bytes as a run never interrupted.
`manifest.json` is written last; until then the folder is not usable as data. A resume is refused
when a source file changed size or modification time since the preparation began.

Stopping. SIGINT and SIGTERM raise KeyboardInterrupt (its argument: the signal's name) in the main
process, which ends the worker pool (workers die quietly) and keeps every recorded shard; while a
batch's shards and progress are being written, the signal waits for the end of the batch, so no
write is cut in the middle.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.encoding import Encoder, batches_of, encoded_batches
from ropelab.data.sources import Source, corpus_key
from ropelab.data.tokenizer import ByteTokenizer, Tokenizer, cache_dir
from ropelab.data.tokens import FORMAT, SPLITS, ShardWriter, read_manifest, token_dtype, write_json
from ropelab.errors import WriteFailed, is_storage_error, one_line
from ropelab.files import one_at_a_time, output_folder

DEFAULT_SHARD_TOKENS = 2**28
PROGRESS = "progress.json"
MANIFEST = "manifest.json"
LOCK = ".lock"  # held while preparing (`one_at_a_time`), never written into
# what a preparation leaves in its folder, finished or not (its atomic writes' and shards' partial files too)
OWN_FILES = (LOCK, PROGRESS, MANIFEST, "tokenizer.json", ".*.partial",
             *(f"{split}-*{ext}" for split in SPLITS for ext in (".bin", ".idx.npy")))
# what marks a run folder (`ropelab.sources.runs`, `ropelab.train.lock`), named when one is refused
RUN_FILES = ("config.yaml", "checkpoints", "metrics.jsonl")


class _StopSignals:
    """SIGINT and SIGTERM as KeyboardInterrupt(signal name) in the main thread, raised at once, or at
    the end of a `writing()` block when they arrive in one (raised inside numpy's np.save, the
    exception turns into a TypeError and a traceback). A signal that was ignored stays ignored."""

    def __init__(self) -> None:
        self._writing = False
        self._pending: Optional[str] = None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self._writing:
            raise KeyboardInterrupt(name)
        self._pending = name

    @contextlib.contextmanager
    def installed(self):
        previous = {}
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def writing(self):
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
        if self._pending is not None:
            raise KeyboardInterrupt(self._pending)


def _progress(enabled: bool, total: Optional[int]):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("[bold]prepare")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    return Progress(*columns, disable=not enabled, transient=False)


def _first_difference(a: dict, b: dict) -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key}: {b.get(key)!r} there, {a.get(key)!r} now"
    return ""


def preparation_folder(out_dir: str | Path) -> Path:
    """`out_dir` as a Path `prepare` may write into: new, empty, or holding its own earlier preparation
    (finished, or unfinished to resume); anything else, a run folder above all, is a one-line ConfigError
    before anything is written."""
    folder = output_folder(out_dir, "ropelab data prepare", own=None)
    if not folder.is_dir():
        return folder
    lock = folder / LOCK
    found = [name for name in RUN_FILES if (folder / name).exists()]
    if lock.is_file() and lock.stat().st_size:  # a trainer's lock records its holder; a preparation's stays empty
        found.append(f"{LOCK} of a trainer")
    if found:
        raise ConfigError(f"--out {folder}: a run folder ({', '.join(found)}); data prepare writes only into a new "
                          "folder or its own unfinished preparation (nothing was written)")
    names = {entry.name for entry in folder.iterdir()}
    leftovers = {LOCK} | {name for name in names if name.endswith(".partial")}
    if names - leftovers and not names & {PROGRESS, MANIFEST}:
        raise ConfigError(f"--out {folder}: not empty and holds no preparation (no {PROGRESS} or {MANIFEST}); "
                          "choose a new folder (nothing was written)")
    return output_folder(folder, "ropelab data prepare", OWN_FILES)


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
    preparation_folder(folder)
    with one_at_a_time(folder / LOCK):  # concurrent runs of the built-in corpus wait here
        if (folder / MANIFEST).is_file():
            manifest = read_manifest(folder)
            if manifest["settings"] != settings:
                raise ConfigError(f"--out {folder}: already holds data prepared with other settings ({_first_difference(settings, manifest['settings'])})")
            return manifest
        state = _load_progress(folder, settings, source)
        try:
            write_json(folder / PROGRESS, state)
            return _run(source, tokenizer, folder, settings, state, workers or os.cpu_count() or 1, progress)
        except OSError as exc:
            if not is_storage_error(exc):
                raise
            kept = sum(len(records) for records in state["splits"].values())
            raise WriteFailed(f"{folder}: {one_line(exc)}; the {kept} completed shard(s) are kept: "
                              "run the same command again once there is room") from None


def _load_progress(folder: Path, settings: dict, source: Source) -> dict:
    """The state of an unfinished preparation in `folder`, or a new one. A resume is refused when the
    settings differ, or when a source file changed: the recorded shards hold its old text."""
    path = folder / PROGRESS
    stamps = source.file_stamps()
    if not path.is_file():
        return {"settings": settings, "source_files": stamps, "splits": {split: [] for split in SPLITS}}
    try:
        state = json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path}: not valid JSON, so the preparation cannot resume; prepare into a new folder") from None
    changed = _changed_file(state.setdefault("source_files", stamps), stamps)  # none recorded by older versions
    if changed:
        raise ConfigError(
            f"--source {source.spec}: {changed} since the unfinished preparation in {folder} began; its completed "
            "shards hold the old text: restore the file, or prepare into a new folder (nothing was written)"
        )
    if state["settings"] != settings:
        raise ConfigError(
            f"--out {folder}: holds an unfinished preparation with other settings ({_first_difference(settings, state['settings'])}); "
            "re-run it with its settings, or choose a new folder"
        )
    return state


def _changed_file(before: dict, now: dict) -> str:
    """The first source file that differs between two `Source.file_stamps`, and how; "" when none."""
    for path in sorted(set(before) | set(now)):
        if path not in now:
            return f"{path} was removed"
        if path not in before:
            return f"{path} was added"
        if now[path][0] != before[path][0]:
            return f"{path} changed size ({before[path][0]} -> {now[path][0]} bytes)"
        if now[path][1] != before[path][1]:
            return f"{path} was modified"
    return ""


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
    batches = encoded_batches(encoder, batches_of(documents), workers)
    stop = _StopSignals()
    with stop.installed(), _progress(show, limit) as bar, contextlib.closing(batches):
        task = bar.add_task("prepare", total=limit, completed=restart, status="")
        for batch in batches:
            with stop.writing():
                at_limit = any(add(item) for item in batch)
            if at_limit:
                break
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.update(task, completed=totals["documents_read"], status=(
                f"{totals['documents']:,} docs {totals['tokens']:,} tokens  "
                f"{(totals['documents_read'] - restart) / elapsed:,.0f} docs/s {(totals['tokens'] - tokens_at_start) / elapsed:,.0f} tokens/s"))
        with stop.writing():
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
    write_json(folder / MANIFEST, manifest)
    (folder / PROGRESS).unlink()
    return manifest


def builtin_token_folder(corpus: str, tokenizer: Tokenizer, val_percent: float) -> Path:
    """The built-in corpus tokenized into the cache (once), keyed by corpus, split and tokenizer."""
    folder = cache_dir() / "tokens" / f"{corpus}-{corpus_key(corpus, val_percent)}-{tokenizer.fingerprint()}-{FORMAT}"
    if not (folder / MANIFEST).is_file():
        prepare(Source(corpus), tokenizer, folder, val_percent=val_percent, progress=False)
    return folder
