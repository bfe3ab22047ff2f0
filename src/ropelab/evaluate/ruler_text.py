"""The raw material of RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654), all offline.

  noise        RULER's repeated sentence, "The grass is green. The sky is blue. ...";
  essay        see `ropelab.evaluate.ruler_essay`;
  words        the word lists of the `wonderwords` package, as RULER draws them: adjective-noun pairs
               for needle keys and values, single nouns, adjectives and verbs for common words; past
               those (more than `len(common_words())` distinct words, about 190k tokens), RULER takes
               every word of a common-words list from a second, larger English list (its
               json/english_words.json, kept in Git LFS): here the lowercase words of the `web2`
               list (Webster's Second International, 234,450 words) of the `english-words` package;
  values       7-digit numbers, UUIDs (version 4), variable names of capital letters, coded words.

Every draw takes a `numpy.random.Generator`, so an item is a function of its seed.
"""

from __future__ import annotations

import string
import uuid
from functools import lru_cache
from importlib import resources

import numpy as np
from english_words import get_english_words_set

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.round(np.linspace(0, 100, 40)).astype(int)  # RULER's needle depths in percent of the sentences


@lru_cache(maxsize=None)
def word_list(name: str) -> tuple[str, ...]:
    """A `wonderwords` list ("noun", "adjective", "verb"): distinct, sorted."""
    text = resources.files("wonderwords").joinpath("assets", f"{name}list.txt").read_text(encoding="utf-8")
    return tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs together, distinct and sorted: the words of common-words extraction."""
    return tuple(sorted(set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb"))))


@lru_cache(maxsize=1)
def more_common_words() -> tuple[str, ...]:
    """The second, larger list of common-words extraction: web2's lowercase words, sorted."""
    return tuple(sorted(get_english_words_set(["web2"], lower=True, alpha=True)))


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
