"""What the generators of the shipped local lm-eval tasks share (`lambada_stdlib`, `nextline_stdlib`, `lambada_wiki`).

  corpus_split(corpus, ...)     (validation documents, training texts) of a built-in corpus
  LastWordItem                  an item of a LAMBADA-like task: a context and its last word
  has_word(word, text)          whether a word occurs in a text as a whole word
  sample_in_turn(pools, ...)    candidates drawn from each document in turn, so that no document dominates
  write_items(items, path)      the task's jsonl file, one dataclass item a line
  generator_main(...)           the generator's command line (``--out``, ``--count``, ``--seed``)
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

from ropelab.data.corpus import in_validation
from ropelab.data.sources import builtin_documents

COUNT = 300
SEED = 0
T = TypeVar("T")


@dataclass(frozen=True)
class LastWordItem:
    context: str
    target: str  # the last word, with the spaces before it
    source: str  # "document:position" of the target (a file's line, an article's sentence)


def corpus_split(corpus: str, val_percent: float = 2.0) -> tuple[list[tuple[str, str]], list[str]]:
    """((key, text) of every validation document, text of every training document) of a built-in
    corpus, in the corpus's order (a stdlib corpus: path order; a Wikipedia corpus: title order)."""
    validation, training = [], []
    for key, text in builtin_documents(corpus):
        if in_validation(key, val_percent):
            validation.append((key, text))
        else:
            training.append(text)
    return validation, training


def has_word(word: str, text: str, ignore_case: bool = False) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE if ignore_case else 0) is not None


def sample_in_turn(pools: Iterable[Sequence[T]], accept: Callable[[T], bool], count: int, rng: random.Random) -> list[T]:
    """`count` accepted candidates (fewer if the pools hold fewer): each pool (one document's candidates,
    in source order) is shuffled with `rng`, pools in order, then candidates are drawn from the pools in
    turn, each pool's next accepted one, until `count`; listed in pool and source order."""
    shuffled = []
    for number, candidates in enumerate(pools):
        order = list(enumerate(candidates))
        rng.shuffle(order)
        shuffled.append((number, iter(order)))
    chosen: list[tuple[int, int, T]] = []
    while shuffled and len(chosen) < count:
        for number, candidates in list(shuffled):
            drawn = next(((index, item) for index, item in candidates if accept(item)), None)
            if drawn is None:
                shuffled.remove((number, candidates))
            elif len(chosen) < count:
                chosen.append((number, *drawn))
    return [item for _, _, item in sorted(chosen, key=lambda entry: entry[:2])]


def write_items(items: Sequence, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(item)) + "\n" for item in items))


def generator_main(module: str, doc: str, task_file: Path, make_items: Callable[[int, int], Sequence],
                   argv: Optional[Sequence[str]] = None) -> None:
    """``python -m MODULE [--out FILE] [--count N] [--seed S]``: write `make_items(count, seed)` (items with
    a ``source`` of ``document:position``) to FILE and say how many items from how many documents."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=task_file, help=f"the jsonl file to write (default {task_file})")
    parser.add_argument("--count", type=int, default=COUNT, help=f"number of items (default {COUNT})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"sampling seed (default {SEED})")
    args = parser.parse_args(argv)
    if args.count <= 0:
        parser.error(f"--count {args.count}: must be > 0")
    try:
        items = make_items(args.count, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    write_items(items, args.out)
    print(f"{len(items)} items from {len({item.source.rsplit(':', 1)[0] for item in items})} documents -> {args.out}")
