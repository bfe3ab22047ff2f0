"""Long-context retrieval items and the settings of a long-context evaluation.

Retrieval tasks (`TASKS`), each a grid of context lengths x needle depths with a few items per cell:
  passkey  a synthetic haystack, one filler paragraph repeated (the passkey test of Mohtashami &
           Jaggi 2023, "Landmark Attention"), hiding "The pass key is 12345. Remember it. ...";
  needle   a haystack of the run's own validation tokens (packed documents with EOS between them,
           like the seed's packed training data) hiding "The magic number is 12345."
Each prompt ends with its question ("... The magic number is") and the answer is " 12345".

Items are built at the token level: the haystack is a slice of token ids, the encoded needle goes
in at token index round(depth * haystack length) (0 = first, 1 = right before the question), and
every prompt is exactly `length` tokens. An item depends only on (seed, task, length, item index),
the tokenizer and the validation split: every depth of a length hides the same answer in the same
haystack, and runs sharing a data config see identical items (results carry a fingerprint).

RULER's synthetic tasks (`RULER_TASKS`, "ruler" for all of them) are built by
`ropelab.evaluate.ruler_items`. `LongContextSettings` (validated by `make_settings`) says what
`ropelab.evaluate.longctx` measures.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ropelab.config import ConfigError
from ropelab.evaluate.ruler_essay import DEFAULT_HAYSTACK, check_haystack
from ropelab.evaluate.ruler_score import DEFAULT_THRESHOLD
from ropelab.evaluate.ruler_tasks import RULER_TASKS

TASKS = ("passkey", "needle")
RULER = "ruler"  # every RULER task
ALPHABETS = {"digits": "0123456789", "letters": "abcdefghijklmnopqrstuvwxyz"}  # what passkeys and needles are made of
WINDOW_PLACES = ("start", "inside")  # where loss-by-position windows are cut (`longctx.position_windows`)
_TASK_STREAM = {"passkey": 1, "needle": 2}  # seed stream per task (the loss windows use 0)


@dataclass(frozen=True)
class TaskText:
    needle: str  # with {answer}
    question: str
    filler: Optional[str] = None  # repeated to form the haystack; None: validation tokens


TASK_TEXT = {
    "passkey": TaskText(
        needle="\nThe pass key is {answer}. Remember it. {answer} is the pass key.\n",
        question="\nWhat is the pass key? The pass key is",
        filler="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
    ),
    "needle": TaskText(
        needle="\nThe magic number is {answer}.\n",
        question="\nWhat is the magic number? The magic number is",
    ),
}


# ------------------------------------------------------------------ settings


@dataclass
class LongContextSettings:
    """What `evaluate_longctx` measures; every field is also a keyword of it."""

    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # prompt tokens
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle position, 0 = start of the haystack
    items: int = 2  # per (length, depth) cell
    distractors: int = 9  # wrong answers the true one is ranked against
    digits: int = 5  # answer length, in characters of `answer_alphabet`
    answer_alphabet: str = "digits"  # "digits" (no leading zero) or lowercase "letters"
    loss_length: Optional[int] = None  # loss-by-position window; None: the longest length; 0: skip
    loss_windows: int = 4
    loss_buckets: int = 12
    loss_place: str = "start"  # loss-by-position windows at document starts, or "inside" long documents
    seed: int = 0
    batch_size: int = 8  # prompts (or loss-by-position windows) per forward pass
    threshold: float = DEFAULT_THRESHOLD  # RULER's effective length: the longest length whose RULER-11 mean beats it
    haystack: str = DEFAULT_HAYSTACK  # RULER's essay haystack: wiki-prose, stdlib-prose or RULER's PaulGrahamEssays.json

    def validate(self) -> "LongContextSettings":
        self.tasks = tuple(name for task in self.tasks for name in (RULER_TASKS if task == RULER else (task,)))
        unknown = [t for t in self.tasks if t not in TASKS and t not in RULER_TASKS]
        if unknown or not self.tasks:
            raise ConfigError(f"tasks={','.join(self.tasks)}: choose one or more of {', '.join(TASKS)}, {RULER} "
                              f"(all of RULER's tasks) or any of {', '.join(RULER_TASKS)}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not 0 <= self.threshold <= 100:
            raise ConfigError(f"threshold={self.threshold}: must be in [0, 100] (an average RULER score in percent)")
        check_haystack(self.haystack)
        if not self.lengths or min(self.lengths) < 1:
            raise ConfigError(f"lengths={list(self.lengths)}: need one or more context lengths >= 1 token")
        for key in ("tasks", "lengths", "depths"):
            if len(set(getattr(self, key))) != len(getattr(self, key)):
                raise ConfigError(f"{key}={list(getattr(self, key))}: has repeats")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"depths={list(self.depths)}: need one or more needle depths in [0, 1]")
        if not 1 <= self.digits <= 18:
            raise ConfigError(f"digits={self.digits}: must be in [1, 18]")
        if self.answer_alphabet not in ALPHABETS:
            raise ConfigError(f"answer_alphabet={self.answer_alphabet!r}: choose one of {', '.join(ALPHABETS)}")
        possible = answer_count(self.answer_alphabet, self.digits)
        if not 1 <= self.distractors < possible:
            raise ConfigError(f"distractors={self.distractors}: must be >= 1 and fewer than the {possible} answers of "
                              f"{self.digits} {self.answer_alphabet}")
        for key in ("items", "loss_buckets", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.loss_place not in WINDOW_PLACES:
            raise ConfigError(f"loss_place={self.loss_place!r}: choose one of {', '.join(WINDOW_PLACES)}")
        if self.loss_windows < 0 or (self.loss_length is not None and self.loss_length < 0):
            raise ConfigError("loss_length and loss_windows: must be >= 0 (0 skips loss by position)")
        return self

    @property
    def loss_tokens(self) -> int:
        """Positions scored by loss by position (0: skipped)."""
        length = max(self.lengths) if self.loss_length is None else self.loss_length
        return length if self.loss_windows else 0


def replace_validated(settings: Any, options: dict, kind: str, comma_lists: tuple[str, ...] = ()) -> Any:
    """A settings dataclass with `options` replacing fields (lists as tuples; the `comma_lists` fields
    also as "a,b" strings), validated; an unknown option is a ConfigError naming it and the `kind`."""
    names = {f.name for f in dataclasses.fields(settings)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown {kind} option; allowed: {', '.join(sorted(names))}")
    options = {k: [t.strip() for t in v.split(",") if t.strip()] if k in comma_lists and isinstance(v, str) else v
               for k, v in options.items()}
    options = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in options.items()}
    return dataclasses.replace(settings, **options).validate()


def make_settings(settings: Optional[LongContextSettings] = None, **options: Any) -> LongContextSettings:
    """`settings` (default: the defaults) with `options` replacing fields, validated."""
    return replace_validated(settings or LongContextSettings(), options, "long-context", ("tasks",))


# ------------------------------------------------------------------ items


@dataclass
class Item:
    task: str
    length: int
    depth: float
    index: int
    prompt: np.ndarray  # (length,) token ids
    needle_at: int  # token index where the needle starts in the prompt
    answer: str
    candidates: list[list[int]] = field(repr=False)  # token ids; candidates[0] is the true answer

    @property
    def positions(self) -> int:
        """Positions the item needs: its prompt and its longest candidate."""
        return len(self.prompt) + max(len(c) for c in self.candidates)


def answer_count(alphabet: str, length: int) -> int:
    """How many answers of `length` characters `alphabet` has (digits: no leading zero)."""
    return 9 * 10 ** (length - 1) if alphabet == "digits" else len(ALPHABETS[alphabet]) ** length


def _answers(rng: np.random.Generator, alphabet: str, length: int, count: int) -> list[str]:
    """`count` distinct answers of exactly `length` characters of `alphabet` (numbers: no leading zero)."""
    chosen: list[str] = []
    while len(chosen) < count:
        if alphabet == "digits":
            value = str(int(rng.integers(10 ** (length - 1), 10**length)))
        else:
            value = "".join(ALPHABETS[alphabet][i] for i in rng.integers(0, len(ALPHABETS[alphabet]), length))
        if value not in chosen:
            chosen.append(value)
    return chosen


class Filler:
    """The passkey haystack: one paragraph's tokens repeated, read like a `TokenSplit`."""

    def __init__(self, tokenizer, text: str, length: int):
        unit = np.asarray(tokenizer.encode_batch([text])[0], dtype=np.int64)
        self.stream = np.tile(unit, length // len(unit) + 2)
        self.num_tokens = len(self.stream)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.stream[start:stop]


def haystack_source(tokenizer, task: str, validation, length: int):
    """What the haystacks of `task` are cut from (`num_tokens`, `tokens(start, stop)`): the validation
    split, or the task's filler repeated past `length` tokens."""
    filler = TASK_TEXT[task].filler
    return validation if filler is None else Filler(tokenizer, filler, length)


def build_items(tokenizer, task: str, source, settings: LongContextSettings) -> list[Item]:
    """Every item of `task`, cell by cell (length-major, then depth, then item index); haystacks are cut
    from `source` (`haystack_source`)."""
    text = TASK_TEXT[task]
    items = []
    for length in settings.lengths:
        for index in range(settings.items):
            rng = np.random.default_rng([settings.seed, _TASK_STREAM[task], length, index])
            answers = _answers(rng, settings.answer_alphabet, settings.digits, settings.distractors + 1)
            needle, question, *candidates = tokenizer.encode_batch(
                [text.needle.format(answer=answers[0]), text.question] + [" " + a for a in answers]
            )
            hay_len = length - len(needle) - len(question)
            if hay_len < 1:
                raise ConfigError(
                    f"lengths: {length} tokens cannot hold the {task} needle and question "
                    f"({len(needle) + len(question)} tokens with this tokenizer)"
                )
            if hay_len > source.num_tokens:
                raise ConfigError(
                    f"{task}: the validation split has {source.num_tokens} tokens, fewer than the {hay_len} "
                    f"of a {length}-token haystack"
                )
            start = int(rng.integers(0, source.num_tokens - hay_len + 1))
            hay = np.asarray(source.tokens(start, start + hay_len), dtype=np.int64)
            for depth in settings.depths:
                at = int(round(depth * hay_len))
                prompt = np.concatenate([hay[:at], needle, hay[at:], question]).astype(np.int64)
                items.append(Item(task, length, depth, index, prompt, at, answers[0], candidates))
    items.sort(key=lambda it: (it.length, settings.depths.index(it.depth), it.index))
    return items


def items_fingerprint(items: Sequence[Item]) -> str:
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.prompt.tobytes())
        for candidate in item.candidates:
            digest.update(np.asarray(candidate, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]
