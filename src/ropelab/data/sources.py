"""Document sources: the built-in corpora (`stdlib`, `stdlib-prose`, `wiki-prose`, `shakespeare`), local files, or a Hugging Face dataset.

A source yields ``(key, text)`` pairs in a fixed order; the key decides the validation split
(`corpus.in_validation`): the relative path for a stdlib corpus (the same split for both), the
article's title for a Wikipedia corpus, the play's name for `shakespeare`, None elsewhere, meaning the text itself, so a document lands in the same split
whatever its position.

Spec strings (``--source``):
  * ``stdlib``                    – the built-in corpus of standard-library source;
  * ``stdlib-prose``              – the built-in corpus of its docstrings and comments (`ropelab.data.prose`);
  * ``wiki-prose`` (``-fr``, ``-es``) – the built-in corpus of Wikipedia lead sections (`ropelab.data.wiki`);
  * ``shakespeare``               – the built-in corpus of Shakespeare's plays (`ropelab.data.shakespeare`);
  * a ``.jsonl``/``.json``/``.parquet``/``.txt`` file, or a folder of such files (one type,
    read in path order). A ``.txt`` file is one document; json and parquet rows are documents
    whose text is in `text_field`;
  * ``hf:NAME`` or a bare ``owner/name`` that is not a local path – ``datasets.load_dataset(NAME,
    config, split=split, streaming=True)``, a hub dataset or a local dataset repository folder.
Local files are read through the same `datasets` builders as hub data, so one code path is
exercised by the tests. Every failure a user can cause surfaces as a one-line `ConfigError`.
"""

from __future__ import annotations

import codecs
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ropelab import hub
from ropelab.config import ConfigError
from ropelab.data.corpus import in_validation, stdlib_entries, stdlib_files, stdlib_root, stdlib_text, wants_validation
from ropelab.data.prose import EXTRACTION, stdlib_prose
from ropelab.data import shakespeare
from ropelab.data.wiki import WIKI_CORPORA, corpus_identity, describe_wiki, wiki_articles
from ropelab.errors import one_line

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
HUB_TIMEOUT_S = 5.0
STDLIB_CORPORA = {"stdlib": stdlib_text, "stdlib-prose": stdlib_prose}  # name -> the document of one stdlib file
TEXT_CORPORA = (*WIKI_CORPORA, shakespeare.CORPUS)  # built-in corpora of natural text: a BPE for them learns from them
BUILTIN_CORPORA = (*STDLIB_CORPORA, *TEXT_CORPORA)


def corpus_key(corpus: str, val_percent: float) -> str:
    """Short stable key for caches derived from a corpus and its split."""
    if corpus in STDLIB_CORPORA:
        ident = f"{corpus}:{sys.version_info.major}.{sys.version_info.minor}:{stdlib_root()}:{val_percent}"
        if corpus == "stdlib-prose":
            ident += f":{EXTRACTION}"
    elif corpus in WIKI_CORPORA:
        ident = f"{corpus_identity(corpus)}:{val_percent}"
    elif corpus == shakespeare.CORPUS:
        ident = f"{shakespeare.corpus_identity()}:{val_percent}"
    else:
        ident = f"{Path(corpus).resolve()}:{val_percent}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def builtin_documents(corpus: str, skip: int = 0) -> Iterator[tuple[str, str]]:
    """(key, text) of every document of a built-in corpus from position `skip` on, in the corpus's order."""
    if corpus in WIKI_CORPORA:
        yield from wiki_articles(corpus)[skip:]
        return
    if corpus == shakespeare.CORPUS:
        yield from shakespeare.shakespeare_plays()[skip:]
        return
    document = STDLIB_CORPORA[corpus]
    for relative, path in stdlib_entries()[skip:]:
        yield relative, document(path)


def corpus_documents(corpus: str, split: str, val_percent: float = 2.0) -> Iterator[str]:
    """The non-empty texts of one split of a built-in corpus, in the corpus's order (a stdlib corpus reads
    only the split's files)."""
    if corpus in STDLIB_CORPORA:
        texts = map(STDLIB_CORPORA[corpus], stdlib_files(split, val_percent))
        return (text for text in texts if text.strip())
    if corpus in WIKI_CORPORA:
        want_validation = wants_validation(split)
        return (text for title, text in wiki_articles(corpus) if in_validation(title, val_percent) == want_validation)
    if corpus == shakespeare.CORPUS:
        want_validation = wants_validation(split)
        return (text for play, text in shakespeare.shakespeare_plays() if in_validation(play, val_percent) == want_validation)
    raise ConfigError(f"data.corpus={corpus!r}: text documents are only built in for {', '.join(BUILTIN_CORPORA)}; "
                      "prepare other sources into a token folder")


def describe_builtin(corpus: str) -> dict:
    """What a manifest records of a built-in corpus: its origin (and licence, for Wikipedia's and Shakespeare's text)."""
    if corpus in WIKI_CORPORA:
        return describe_wiki(corpus)
    if corpus == shakespeare.CORPUS:
        return shakespeare.describe_shakespeare()
    out = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}  # the running Python's own source
    if corpus == "stdlib-prose":
        out["extraction"] = EXTRACTION
    return out


def check_hub_reachable(name: str) -> None:
    """Fail fast, in one line, when the Hugging Face hub cannot be reached (offline mode, no DNS, no route)."""
    variable = hub.offline_variable()
    if variable is not None:
        raise ConfigError(f"--source {name}: {variable} is set, so the Hugging Face hub is off; pass a local file or folder instead")
    reason = hub.unreachable_reason(HUB_TIMEOUT_S)
    if reason is not None:
        host, port = hub.address()
        raise ConfigError(
            f"--source {name}: cannot reach {host}:{port} ({reason}); check the network, or download the data and pass a local file or folder"
        )


@dataclass
class Source:
    """Where documents come from; `describe()` is what the manifest records."""

    spec: str
    hf_config: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    encoding_errors: str = "strict"  # for .txt and json files: strict | replace | ignore

    def __post_init__(self) -> None:
        self.kind, self.location = self._classify()
        self.files: list[Path] = self._local_files() if self.kind == "local" else []

    def _classify(self) -> tuple[str, str]:
        if self.spec in BUILTIN_CORPORA:
            return self.spec, self.spec
        if self.spec.startswith("hf:"):
            return "dataset", self.spec[3:]
        path = Path(self.spec).expanduser()
        if path.exists():
            return "local", str(path.resolve())
        if path.suffix.lower() in LOCAL_BUILDERS or not _HUB_NAME.match(self.spec):
            raise ConfigError(f"--source {self.spec}: file or folder not found")
        return "dataset", self.spec

    def _local_files(self) -> list[Path]:
        path = Path(self.location)
        if path.is_file():
            if path.suffix.lower() not in LOCAL_BUILDERS:
                raise ConfigError(f"--source {self.spec}: unsupported file type {path.suffix or '(none)'!r}; use {', '.join(LOCAL_BUILDERS)}")
            return [path]
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_BUILDERS)
        if not files:
            raise ConfigError(f"--source {self.spec}: folder holds no {', '.join(LOCAL_BUILDERS)} files")
        builders = {LOCAL_BUILDERS[p.suffix.lower()] for p in files}
        if len(builders) > 1:
            raise ConfigError(f"--source {self.spec}: folder mixes file types ({', '.join(sorted(builders))}); prepare one type per run")
        return files

    def describe(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "name": self.location}
        if self.kind in BUILTIN_CORPORA:
            out |= describe_builtin(self.kind)
        if self.kind == "local":
            out["files"] = len(self.files)
        if self.kind == "dataset":
            out |= {"config": self.hf_config, "split": self.split}
        if self.kind not in BUILTIN_CORPORA:
            out["text_field"] = self.text_field
        return out

    def file_stamps(self) -> dict[str, list[int]]:
        """{file: [size, modification time in ns]} of the local files the documents come from (a local
        dataset folder's, hidden ones such as .git/ left out); empty for the built-in corpora and hub datasets."""
        root = Path(self.location)
        if self.kind == "local":
            files = self.files
        elif self.kind == "dataset" and root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(root).parts))
        else:
            files = []
        stats = {str(p): p.stat() for p in files}
        return {path: [s.st_size, s.st_mtime_ns] for path, s in stats.items()}

    # ------------------------------------------------------------------ reading

    def documents(self, skip: int = 0) -> Iterator[tuple[Optional[str], Optional[str]]]:
        """(key, text) of every document from position `skip` on; text None for a missing value."""
        if self.kind in BUILTIN_CORPORA:
            yield from builtin_documents(self.kind, skip)
            return
        rows = self._rows()
        if skip:
            rows = rows.skip(skip)
        index = skip
        iterator = iter(rows)
        while True:
            try:
                row = next(iterator)
            except StopIteration:
                return
            except UnicodeDecodeError as exc:
                raise ConfigError(self._decode_error(exc)) from None
            except Exception as exc:  # the datasets/pyarrow readers: a bad file or a lost connection
                raise ConfigError(f"--source {self.spec}: could not read document {index} ({one_line(exc)})") from None
            yield None, self._text(row, index)
            index += 1

    def _rows(self):
        try:
            import datasets
        except ImportError:
            raise ConfigError("reading files and datasets needs the `datasets` package: pip install datasets") from None
        datasets.disable_progress_bars()
        if self.kind == "dataset" and not Path(self.location).exists():
            check_hub_reachable(self.location)
        try:
            if self.kind == "dataset":
                rows = datasets.load_dataset(self.location, self.hf_config, split=self.split, streaming=True)
            else:
                builder = LOCAL_BUILDERS[self.files[0].suffix.lower()]
                options = {} if builder == "parquet" else {"encoding_errors": self.encoding_errors}
                if builder == "text":
                    options["sample_by"] = "document"
                rows = datasets.load_dataset(builder, data_files=[str(p) for p in self.files], split="train", streaming=True, **options)
        except Exception as exc:  # missing repo or config, no network, unreadable files
            raise ConfigError(f"--source {self.spec}: could not open ({one_line(exc)})") from None
        columns = getattr(rows, "column_names", None)
        if columns is not None and self.text_field not in columns:
            raise ConfigError(f"--source {self.spec}: no text field {self.text_field!r}; fields are {', '.join(columns)} (choose with --text-field)")
        return rows

    def _text(self, row: dict, index: int) -> Optional[str]:
        if self.text_field not in row:
            raise ConfigError(f"--source {self.spec}: document {index} has no field {self.text_field!r}; fields are {', '.join(row)} (choose with --text-field)")
        value = row[self.text_field]
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"--source {self.spec}: field {self.text_field!r} of document {index} is {type(value).__name__}, not text")
        return value

    def _decode_error(self, exc: UnicodeDecodeError) -> str:
        """Name the first local file that is not valid text in the source's encoding."""
        for path in self.files:
            decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
            with open(path, "rb") as f:
                while True:
                    block = f.read(1 << 20)
                    try:
                        decoder.decode(block, final=not block)
                    except UnicodeDecodeError as bad:
                        return f"{path}: not valid UTF-8 (near byte {offset + bad.start}); fix the file or pass --encoding-errors replace"
                    if not block:
                        break
                    offset += len(block)
        return f"--source {self.spec}: not valid UTF-8 ({exc.reason}); pass --encoding-errors replace to substitute U+FFFD"
