"""`lambada_stdlib`: a LAMBADA-like local lm-eval task built from the `stdlib` validation split.

LAMBADA asks for the last word of a passage that only the wider context gives away; here the
word is an identifier of Python code, which a model can find only by looking back in the passage.
An item is ``{"context", "target", "source"}``: the model scores ``target`` after ``context``
(`configs/eval/lambada_stdlib.yaml`: accuracy of greedy prediction and perplexity, as the
harness's ``lambada_openai``), and ``source`` is ``path:line`` of the target in the stdlib.

The rule. A target is an identifier token of a validation file's code (``tokenize.NAME``) such that:
  * it has at least 3 characters (`MIN_TARGET_CHARS`) and is no keyword, builtin, ``self`` or ``cls``;
  * something other than indentation comes before it on its line (the passage's last line);
  * the passage is the longest run of whole lines ending at the target with at most 200
    characters before it (`CONTEXT_CHARS`), and has at least one line before the last;
  * the target appears, as a whole word, in the passage's earlier lines and not in its last line
    (so the last line alone does not give it away, and the context does);
  * the last line up to and with the target, indentation left off, occurs nowhere in the training split
    (so a model cannot complete it from memory: codec boilerplate and common lines are left out).
The spaces between the target and the word before it belong to the target (`` target``), as in
lambada_openai. Sampling: each file's candidates are shuffled with `random.Random(seed)`, files in
path order, then items are drawn from the files in turn (so no file dominates) until `count`, and
listed in file and line order.

Regenerate the shipped file (the running Python's stdlib; the shipped one is from Python 3.11):
    python -m ropelab.evaluate.lambada_stdlib --out configs/eval/lambada_stdlib.jsonl
"""

from __future__ import annotations

import builtins
import io
import keyword
import random
import tokenize
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ropelab.evaluate.task_generators import COUNT, SEED, LastWordItem, corpus_split, generator_main, has_word, sample_in_turn

CONTEXT_CHARS = 200
MIN_TARGET_CHARS = 3
TASK_FILE = Path("configs/eval/lambada_stdlib.jsonl")
TRIVIAL = frozenset(dir(builtins)) | {"self", "cls"}


def is_target_name(name: str) -> bool:
    """Whether an identifier may be a target (long enough, and not predictable from the language alone)."""
    return (len(name) >= MIN_TARGET_CHARS and name not in TRIVIAL
            and not keyword.iskeyword(name) and not keyword.issoftkeyword(name))


def file_items(key: str, source: str, context_chars: int = CONTEXT_CHARS) -> list[LastWordItem]:
    """Every item the rule allows in one file, in source order (none when the file does not tokenize)."""
    lines = io.StringIO(source).readlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return []
    items = []
    for token in tokens:
        (row, col), name = token.start, token.string
        if token.type != tokenize.NAME or not is_target_name(name):
            continue
        last_line = lines[row - 1][:col]
        if not last_line.strip() or has_word(name, last_line):
            continue
        offset = starts[row - 1] + col
        first = next((r for r in range(row) if starts[r] >= offset - context_chars), row - 1)  # 0-based first line of the passage
        if first >= row - 1 or not has_word(name, source[starts[first]:starts[row - 1]]):
            continue
        context = source[starts[first]:offset]
        kept = context.rstrip(" \t")
        items.append(LastWordItem(kept, context[len(kept):] + name, f"{key}:{row}"))
    return items


def last_line(item: LastWordItem) -> str:
    """The passage's last line up to and including the target, indentation left off."""
    return (item.context.rsplit("\n", 1)[-1] + item.target).lstrip()


def sample_items(documents: Iterable[tuple[str, str]], seen: str, count: int = COUNT, seed: int = SEED) -> list[LastWordItem]:
    """`count` items (fewer if the documents hold fewer) from (key, source text) documents, whose last
    line is not in `seen` (the training text), drawn from each document in turn after a shuffle by
    `seed`; listed in document and line order."""
    pools = (file_items(key, text) for key, text in documents)
    return sample_in_turn(pools, lambda item: last_line(item) not in seen, count, random.Random(seed))


def stdlib_items(count: int = COUNT, seed: int = SEED, val_percent: float = 2.0) -> list[LastWordItem]:
    """The task's items from the validation files of the running Python's standard library."""
    documents, training = corpus_split("stdlib", val_percent)
    return sample_items(documents, "\n".join(training), count, seed)


def main(argv: Optional[Sequence[str]] = None) -> None:
    generator_main("ropelab.evaluate.lambada_stdlib", __doc__, TASK_FILE, stdlib_items, argv)


if __name__ == "__main__":
    main()
