"""`nextline_stdlib`: a multiple-choice local lm-eval task built from the `stdlib` validation split.

An item is a passage of Python source and four candidates for its next line: the model scores each
choice as the continuation of the passage (`configs/eval/nextline_stdlib.yaml`: acc and acc_norm, as
the harness's multiple-choice tasks). An item is ``{"context", "choices", "label", "source"}``:
``context`` is the passage (whole lines, so it ends in a newline), ``choices[label]`` the true next
line and ``source`` ``path:line`` of that line in the stdlib.

The rule. A true line is a line of a validation file such that:
  * it has at least 8 characters besides indentation (`MIN_LINE_CHARS`): no blank or trivial line; it
    is kept with its indentation, trailing whitespace left off;
  * the passage is the longest run of whole lines right before it with at most 200 characters
    (`CONTEXT_CHARS`), and has at least two non-blank lines (blank lines right before the true line
    belong to the passage: the true line is the passage's next non-blank line);
  * the line, indentation left off, is no line of the training split, indentation left off (so a
    model cannot recall it from memory).
Sampling: `COUNT` true lines are drawn as lambada_stdlib's targets are (each file's candidates shuffled
with `random.Random(seed)`, files in path order, then drawn from the files in turn so that no file
dominates) and listed in file and line order. Choices: an item's 3 distractors are the true lines of
the other items from other files closest in length to its own (ties: in item order), none equal to
its true line or to one another once indentation is left off; then, item by item, the 4 choices are
shuffled by the same `random.Random`, and ``label`` is the true line's index.

Regenerate the shipped file (the running Python's stdlib; the shipped one is from Python 3.11):
    python -m ropelab.evaluate.nextline_stdlib --out configs/eval/nextline_stdlib.jsonl
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Container, Iterable, Optional, Sequence

from ropelab.evaluate.task_generators import COUNT, SEED, corpus_split, generator_main, sample_in_turn

CONTEXT_CHARS = 200
MIN_LINE_CHARS = 8
CHOICES = 4
TASK_FILE = Path("configs/eval/nextline_stdlib.jsonl")


@dataclass(frozen=True)
class Passage:
    context: str
    line: str  # the true next line
    source: str  # "path:line" of the true line


@dataclass(frozen=True)
class Item:
    context: str
    choices: list[str]
    label: int
    source: str  # "path:line" of choices[label]


def file_passages(key: str, source: str, context_chars: int = CONTEXT_CHARS) -> list[Passage]:
    """Every passage and true line the rule allows in one file (the training split aside), in source order."""
    lines = io.StringIO(source).readlines()
    passages = []
    first, size = 0, 0  # the passage is lines[first:row], of `size` characters
    for row, line in enumerate(lines):
        if row:
            size += len(lines[row - 1])
        while size > context_chars:
            size -= len(lines[first])
            first += 1
        if len(line.strip()) >= MIN_LINE_CHARS and sum(1 for kept in lines[first:row] if kept.strip()) >= 2:
            passages.append(Passage("".join(lines[first:row]), line.rstrip(), f"{key}:{row + 1}"))
    return passages


def _file(passage: Passage) -> str:
    return passage.source.rsplit(":", 1)[0]


def distractors(passage: Passage, passages: Sequence[Passage]) -> list[str]:
    """The true lines of `passages` from other files closest in length to the passage's (ties: in order),
    `CHOICES - 1` of them, none equal to its true line or to one another once indentation is left off."""
    others = sorted((p for p in passages if _file(p) != _file(passage)), key=lambda p: abs(len(p.line) - len(passage.line)))
    taken, chosen = {passage.line.strip()}, []
    for other in others:
        if len(chosen) == CHOICES - 1:
            break
        if other.line.strip() not in taken:
            taken.add(other.line.strip())
            chosen.append(other.line)
    if len(chosen) < CHOICES - 1:
        raise ValueError(f"{passage.source}: fewer than {CHOICES - 1} distinct lines of other files to draw distractors from")
    return chosen


def sample_items(documents: Iterable[tuple[str, str]], seen: Container[str], count: int = COUNT, seed: int = SEED) -> list[Item]:
    """`count` items (fewer if the documents hold fewer) from (key, source text) documents, whose true
    line, indentation left off, is not in `seen` (the training split's lines, indentation left off)."""
    rng = random.Random(seed)
    pools = (file_passages(key, text) for key, text in documents)
    passages = sample_in_turn(pools, lambda passage: passage.line.strip() not in seen, count, rng)
    items = []
    for passage in passages:
        choices = [passage.line, *distractors(passage, passages)]
        rng.shuffle(choices)
        items.append(Item(passage.context, choices, choices.index(passage.line), passage.source))
    return items


def stdlib_items(count: int = COUNT, seed: int = SEED, val_percent: float = 2.0) -> list[Item]:
    """The task's items from the validation files of the running Python's standard library."""
    documents, training = corpus_split("stdlib", val_percent)
    seen = {line.strip() for text in training for line in text.split("\n")}
    return sample_items(documents, seen, count, seed)


def main(argv: Optional[Sequence[str]] = None) -> None:
    generator_main("ropelab.evaluate.nextline_stdlib", __doc__, TASK_FILE, stdlib_items, argv)


if __name__ == "__main__":
    main()
