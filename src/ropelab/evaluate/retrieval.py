"""Passkey retrieval at 1x, 2x, 4x and 8x a short window: the retrieval measure of the distillation study.

Why passkey. The models this measure is for are tiny (about a million parameters), byte-level and
trained on about 20 tokens per parameter of English text. The one long-range skill such a model can be
expected to learn from plain text is copying: finding an earlier occurrence of the current context and
continuing it as it went on there, the mechanism of the induction heads that small attention models
form early (Olsson et al. 2022, "In-context Learning and Induction Heads"). Shakespeare's plays, the
long documents the teacher reads, repeat speakers' names and phrases throughout, which is that signal.
Passkey retrieval asks for exactly that copy: the question ends with "The pass key is", the words that
preceded the key in the needle, and the answer is the bytes that followed them; the haystack is one
filler paragraph repeated (`ropelab.evaluate.longctx_items`), so nothing in it competes with the needle
and accuracy depends on the distance only. Associative recall (many key-value pairs, one asked for) needs
binding of arbitrary keys, which plain text trains weakly; a needle in the validation text competes with
the text's own repeats. Both would measure a tiny model's noise more than its reach.

Keys of letters. The key is five random lowercase letters (`alphabet`; ``digits`` gives the classic
number): Shakespeare's 38 plays hold 22 digits in 4.9 million bytes, so a byte model trained on them has
never learned what a digit is, and a numeric key would test that, not its reach.

Scoring. Each item's true key is ranked against `distractors` random keys of the same length by summed
log-probability after the prompt (`ropelab.evaluate.longctx.score_items`); an item is retrieved when the
true key is strictly best. Chance is 1 / (distractors + 1) (ties count as misses, so a model that cannot
tell the keys apart scores at most that). Accuracy per length pools the depths, with its 95% Wilson
score interval; a length is above chance when the interval's lower end is. The needle sits at
`depths` of the haystack (0 = its start): at depth 0 of a prompt of k short windows the key is about
k - 1 windows further back than a short-window model ever attended.

A prompt of the byte tokenizer's passkey needs about 100 tokens for the needle and question, so the
short window must exceed that (one line says so otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.evaluate.longctx import score_items
from ropelab.evaluate.longctx_items import LongContextSettings, build_items, haystack_source, items_fingerprint
from ropelab.evaluate.ruler_score import wilson_interval

TASK = "passkey"
INTERVAL = "95% Wilson score interval"


@dataclass
class RetrievalSettings:
    short_window: int  # the students' training window, in tokens
    multiples: tuple[int, ...] = (1, 2, 4, 8)  # prompt lengths, in short windows
    depths: tuple[float, ...] = (0.0, 0.5)  # where the needle sits in the haystack, 0 = its start
    items: int = 20  # per (length, depth)
    distractors: int = 9
    digits: int = 5  # the key's length, in characters of `alphabet`
    alphabet: str = "letters"  # or "digits"
    seed: int = 0
    batch_size: int = 8

    def validate(self) -> "RetrievalSettings":
        if self.short_window < 1 or not self.multiples or min(self.multiples) < 1:
            raise ConfigError(f"retrieval: short_window={self.short_window}, multiples={list(self.multiples)}: "
                              "need a window >= 1 token and multiples >= 1")
        if self.items < 1:
            raise ConfigError(f"retrieval: items={self.items}: must be >= 1")
        self.longctx_settings()  # depths, digits, distractors, repeats
        return self

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(m * self.short_window for m in self.multiples)

    @property
    def chance(self) -> float:
        return 1.0 / (self.distractors + 1)

    def longctx_settings(self) -> LongContextSettings:
        return LongContextSettings(tasks=(TASK,), lengths=self.lengths, depths=tuple(self.depths), items=self.items,
                                   distractors=self.distractors, digits=self.digits,
                                   answer_alphabet=self.alphabet, loss_length=0, seed=self.seed,
                                   batch_size=self.batch_size).validate()


def length_result(multiple: int, length: int, scored: list[dict], chance: float) -> dict:
    """Accuracy of one prompt length with its Wilson interval, and whether it is above chance."""
    correct = sum(r["top1"] for r in scored)
    accuracy = correct / len(scored)
    low, high = wilson_interval(accuracy, len(scored))
    return {"multiple": multiple, "length": length, "n": len(scored), "correct": int(correct), "accuracy": accuracy,
            "interval": [low, high], "above_chance": low > chance, "mrr": float(np.mean([1.0 / r["rank"] for r in scored]))}


def passkey_retrieval(model, tokenizer, settings: RetrievalSettings, device: Any = "cpu") -> dict:
    """Passkey accuracy of `model` at each multiple of the short window: n, correct, accuracy, 95% Wilson
    interval, above chance; with the chance level and the items' fingerprint."""
    settings.validate()
    longctx = settings.longctx_settings()
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    items = build_items(tokenizer, TASK, haystack_source(tokenizer, TASK, None, max(settings.lengths)), longctx)
    if limit is not None and max(it.positions for it in items) > limit:
        raise ConfigError(f"retrieval: prompts of {max(settings.lengths)} tokens and their answers are beyond the "
                          f"model's max_seq_len {limit}")
    was_training = model.training
    model.eval()
    lengths = []
    for multiple, length in zip(settings.multiples, settings.lengths):
        chunk = [it for it in items if it.length == length]
        scored = score_items(model, chunk, tokenizer.decode, tokenizer.eos_id, settings.batch_size, device)
        lengths.append(length_result(multiple, length, scored, settings.chance))
    model.train(was_training)
    return {"task": TASK, "chance": settings.chance, "interval": INTERVAL, "depths": list(settings.depths),
            "items_fingerprint": items_fingerprint(items), "settings": dataclasses.asdict(settings), "lengths": lengths}


def accuracy_at(result: dict, multiples: tuple[int, ...]) -> Optional[dict]:
    """The pooled accuracy of `result`'s lengths at `multiples` (n, correct, accuracy, interval, above chance)."""
    chosen = [r for r in result["lengths"] if r["multiple"] in multiples]
    if not chosen:
        return None
    n, correct = sum(r["n"] for r in chosen), sum(r["correct"] for r in chosen)
    low, high = wilson_interval(correct / n, n)
    return {"multiples": sorted(r["multiple"] for r in chosen), "n": n, "correct": correct, "accuracy": correct / n,
            "interval": [low, high], "above_chance": low > result["chance"]}
