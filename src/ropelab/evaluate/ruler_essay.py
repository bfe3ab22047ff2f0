"""The essay haystack of RULER's niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue and
niah_multiquery (`ESSAY_TASKS` in `ropelab.evaluate.ruler_tasks`).

RULER hides these needles in Paul Graham's essays, the file ``PaulGrahamEssays.json`` that its script
``scripts/data/synthetic/json/download_paulgraham_essay.py`` writes: one JSON object whose "text" holds
every essay, concatenated. Its ``niah.py`` splits that text at whitespace, takes the first N words
(the whole text again and again when N is larger) and puts the needles between sentences. The essays
are not ropelab's to ship, so the haystack (`--haystack`) is one of:

  wiki-prose     the default: the built-in English corpus's Wikipedia lead sections
                 (`ropelab.data.wiki`, the extra ``ropelab[prose]``), articles in title order, each
                 haystack starting at the first word of an article the item's seed picks;
  stdlib-prose   the paragraphs of the built-in `stdlib-prose` corpus (the standard library's docstrings
                 and comments, in path order) that read as sentences: no doctest, shell or list lines, at
                 least `MIN_WORDS` words, mostly words that start with a letter, ending in . ! or ?;
                 `STDLIB_WORDS` words of them, each haystack starting at a sentence the item's seed
                 picks (ropelab's haystack before wiki-prose);
  a JSON file    RULER's own PaulGrahamEssays.json, read as RULER reads it: every haystack starts at
                 the text's first word, so whoever has the file gets RULER's haystacks.

A haystack that reaches the end of its text goes on at the text's start. It *repeats* when it needs
more words than the text has; items say so, and `ropelab eval longctx` warns and reports it.
Sentences end at . ! or ? (and a closing quote or bracket) before a capital letter, quote or bracket:
RULER splits with NLTK's punkt model, a separate download, so needles may sit at other sentence
boundaries than RULER's would.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.corpus import stdlib_entries
from ropelab.data.prose import stdlib_prose
from ropelab.data.wiki import WIKI_SOURCE, describe_wiki, wiki_articles

WIKI = "wiki-prose"
STDLIB = "stdlib-prose"
DEFAULT_HAYSTACK = WIKI
STDLIB_WORDS = 25_000
MIN_WORDS = 12
_NOT_PROSE = (">>>", "...", "$", "-", "*", "|", "+", "=")  # doctest, shell, list and table lines
_SENTENCE_END = re.compile(r"[.!?][\"')]?$")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_FILE_HINT = f"use {WIKI}, {STDLIB} or the path of RULER's PaulGrahamEssays.json"


@dataclass(frozen=True)
class EssayText:
    """The words haystacks are cut from, and where a haystack may start."""

    name: str  # wiki-prose, stdlib-prose or the file's path, as given
    description: str  # where the text comes from, for reports
    words: tuple[str, ...]
    starts: tuple[int, ...]  # word indices a haystack may start at, ascending; (0,) for RULER's file

    def start(self, rng: np.random.Generator) -> int:
        """The first start at or after a random word (after the last start: the first one)."""
        at = bisect.bisect_left(self.starts, int(rng.integers(len(self.words))))
        return self.starts[at % len(self.starts)]

    def sentences(self, start: int, count: int) -> list[str]:
        """`count` words from word `start` on, going on at the text's start, split into sentences."""
        words = [self.words[(start + k) % len(self.words)] for k in range(count)]
        return _SENTENCE_BREAK.split(" ".join(words)) if words else []

    def repeats(self, count: int) -> bool:
        """Whether a haystack of `count` words holds some of the text twice."""
        return count > len(self.words)


def prose_paragraphs(document: str) -> list[str]:
    """The paragraphs of a `stdlib-prose` document that read as sentences, whitespace collapsed."""
    kept = []
    for paragraph in document.split("\n\n"):
        words = paragraph.split()
        if (len(words) >= MIN_WORDS and sum(w[:1].isalpha() for w in words) >= 0.85 * len(words)
                and _SENTENCE_END.search(paragraph.strip())
                and not any(line.lstrip().startswith(_NOT_PROSE) for line in paragraph.splitlines())):
            kept.append(" ".join(words))
    return kept


def _stdlib_text() -> EssayText:
    words: list[str] = []
    for _, path in stdlib_entries():
        for paragraph in prose_paragraphs(stdlib_prose(path)):
            words += paragraph.split()
        if len(words) >= STDLIB_WORDS:
            break
    starts = tuple(i for i in range(len(words)) if _SENTENCE_END.search(words[i - 1]))  # words[-1] ends a paragraph
    return EssayText(STDLIB, "prose paragraphs of the standard library's docstrings and comments (built-in "
                     "stdlib-prose corpus), in path order", tuple(words), starts)


def _wiki_text() -> EssayText:
    articles = wiki_articles(WIKI)
    words: list[str] = []
    starts = []
    for _, text in articles:
        starts.append(len(words))
        words += text.split()
    about = describe_wiki(WIKI)
    return EssayText(WIKI, f"{WIKI_SOURCE}, {len(articles):,} articles in title order ({about['package']}; "
                     f"{about['licence']})", tuple(words), tuple(starts))


def _file_text(path: str) -> EssayText:
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"haystack={path}: cannot be read ({exc.strerror or type(exc).__name__}); {_FILE_HINT}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"haystack={path}: not a JSON file; RULER's PaulGrahamEssays.json is "
                          '{"text": "<every essay, concatenated>"}') from None
    text = data.get("text") if isinstance(data, dict) else None
    if not isinstance(text, str) or not text.split():
        raise ConfigError(f'haystack={path}: needs a "text" field holding the essays (the form of RULER\'s '
                          "PaulGrahamEssays.json)")
    words = tuple(text.split())
    return EssayText(path, f"the essay file {path} ({len(words):,} words, sha256 {hashlib.sha256(raw).hexdigest()[:12]}), "
                     "from its first word as RULER reads it", words, (0,))


@lru_cache(maxsize=None)
def essay_text(haystack: str = DEFAULT_HAYSTACK) -> EssayText:
    """The essay text named `haystack`: wiki-prose, stdlib-prose or the path of a JSON file like RULER's
    PaulGrahamEssays.json; ConfigError (one line naming it) when it cannot be read."""
    if haystack == WIKI:
        return _wiki_text()
    if haystack == STDLIB:
        return _stdlib_text()
    return _file_text(haystack)


def check_haystack(haystack: object) -> None:
    """ConfigError unless `haystack` names a built-in haystack or an existing file (read later)."""
    if not isinstance(haystack, str) or not haystack or (haystack not in (WIKI, STDLIB) and not Path(haystack).is_file()):
        raise ConfigError(f"haystack={haystack}: not a built-in haystack nor a file; {_FILE_HINT}")
