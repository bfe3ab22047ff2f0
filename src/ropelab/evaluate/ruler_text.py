"""The raw material of RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654), all offline.

  noise        RULER's repeated sentence, "The grass is green. The sky is blue. ...";
  essay        English prose in place of RULER's Paul Graham essays: the paragraphs of the built-in
               `stdlib-prose` corpus (the standard library's docstrings and comments, in path order)
               that read as sentences: no doctest, shell or list lines, at least `MIN_WORDS` words,
               mostly words that start with a letter, ending in . ! or ?. `ESSAY_WORDS` words of it
               form a pool that haystacks are cut from (round and round, as RULER repeats its essays),
               each from a sentence start at a word the item's seed picks (RULER starts every
               haystack at the essays' first word);
  words        the word lists of the `wonderwords` package, as RULER draws them: adjective-noun pairs
               for needle keys and values, single nouns, adjectives and verbs for common words;
  values       7-digit numbers, UUIDs (version 4), variable names of capital letters, coded words.

Every draw takes a `numpy.random.Generator`, so an item is a function of its seed.
"""

from __future__ import annotations

import re
import string
import uuid
from functools import lru_cache
from importlib import resources

import numpy as np

from ropelab.data.corpus import stdlib_entries
from ropelab.data.prose import stdlib_prose

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAY_WORDS = 25_000
MIN_WORDS = 12
DEPTHS = np.round(np.linspace(0, 100, 40)).astype(int)  # RULER's needle depths in percent of the sentences
_NOT_PROSE = (">>>", "...", "$", "-", "*", "|", "+", "=")  # doctest, shell, list and table lines
_SENTENCE_END = re.compile(r"[.!?][\"')]?$")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


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


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay pool: about `ESSAY_WORDS` words of prose paragraphs, documents in path order."""
    words: list[str] = []
    for _, path in stdlib_entries():
        for paragraph in prose_paragraphs(stdlib_prose(path)):
            words += paragraph.split()
        if len(words) >= ESSAY_WORDS:
            break
    return tuple(words)


def essay_sentences(start: int, count: int) -> list[str]:
    """`count` words of the essay pool from the first sentence start at or after word `start` on
    (wrapping around), split into sentences."""
    pool = essay_words()
    while not _SENTENCE_END.search(pool[start - 1]):  # pool[-1] ends a paragraph: word 0 starts a sentence
        start = (start + 1) % len(pool)
    words = [pool[(start + k) % len(pool)] for k in range(count)]
    return _SENTENCE_BREAK.split(" ".join(words)) if words else []


@lru_cache(maxsize=None)
def word_list(name: str) -> tuple[str, ...]:
    """A `wonderwords` list ("noun", "adjective", "verb"): distinct, sorted."""
    text = resources.files("wonderwords").joinpath("assets", f"{name}list.txt").read_text(encoding="utf-8")
    return tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs together, distinct and sorted: the words of common-words extraction."""
    return tuple(sorted(set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb"))))


def random_value(rng: np.random.Generator, kind: str) -> str:
    """A needle key or value of RULER's kinds: "numbers" (7 digits), "words" (adjective-noun), "uuids"."""
    if kind == "numbers":
        return str(int(rng.integers(10**6, 10**7)))
    if kind == "words":
        adjectives, nouns = word_list("adjective"), word_list("noun")
        return f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"
    return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def distinct_values(rng: np.random.Generator, kind: str, count: int, avoid: frozenset[str] = frozenset()) -> list[str]:
    """`count` distinct values of `kind`, none of them in `avoid`."""
    chosen: dict[str, None] = {}
    while len(chosen) < count:
        value = random_value(rng, kind)
        if value not in avoid:
            chosen[value] = None
    return list(chosen)


def random_letters(rng: np.random.Generator, count: int, alphabet: str = string.ascii_uppercase) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), count))


def distinct_names(rng: np.random.Generator, count: int, letters: int, alphabet: str = string.ascii_uppercase,
                   avoid: frozenset[str] = frozenset()) -> list[str]:
    """`count` distinct strings of `letters` letters (variable names, coded words), none in `avoid`."""
    chosen: dict[str, None] = {}
    while len(chosen) < count:
        name = random_letters(rng, letters, alphabet)
        if name not in avoid:
            chosen[name] = None
    return list(chosen)


def insert_lines(lines: list[str], inserts: list[str], rng: np.random.Generator) -> list[str]:
    """`lines` with `inserts` put in, in their order, before distinct lines picked at random (RULER's
    needle insertion into the noise and needle haystacks)."""
    at = np.sort(rng.choice(len(lines), size=len(inserts), replace=False)) if lines else np.zeros(len(inserts), int)
    merged = list(lines)
    for offset, (index, line) in enumerate(zip(at, inserts)):
        merged.insert(int(index) + offset, line)
    return merged
