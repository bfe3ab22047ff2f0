"""What the local lm-eval tasks built from the `stdlib` validation split share (`lambada_stdlib`, `nextline_stdlib`).

  stdlib_split(val_percent)     (validation documents, training texts) of the running Python's stdlib
  sample_in_turn(pools, ...)    candidates drawn from each document in turn, so that no document dominates
  write_items(items, path)      the task's jsonl file, one dataclass item a line
  generator_main(...)           the generator's command line (``--out``, ``--count``, ``--seed``)
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

from ropelab.data.corpus import in_validation, stdlib_entries, stdlib_text

COUNT = 300
SEED = 0
T = TypeVar("T")


def stdlib_split(val_percent: float = 2.0) -> tuple[list[tuple[str, str]], list[str]]:
    """((key, text) of every validation file, text of every training file), in path order."""
    validation, training = [], []
    for key, path in stdlib_entries():
        if in_validation(key, val_percent):
            validation.append((key, stdlib_text(path)))
        else:
            training.append(stdlib_text(path))
    return validation, training


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
    a ``source`` of ``path:line``) to FILE and say how many items from how many files."""
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
    print(f"{len(items)} items from {len({item.source.rsplit(':', 1)[0] for item in items})} files -> {args.out}")
