"""RULER items at lengths counted in the model's own tokens.

As RULER does, a length is the whole sequence: the prompt (ending with the task's answer prefix)
plus the task's new tokens (128 for NIAH, 30 for vt, 120 for cwe, 50 for fwe). For each item the
haystack grows (in sentences, words or list entries, see `ropelab.evaluate.ruler_tasks`) to the
largest size whose prompt, encoded by the model's tokenizer, still leaves room for the new tokens:
the prompt falls short of length - new tokens by less than one haystack unit. An item depends only
on (seed, task, length, item index) and the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ropelab.errors import ConfigError
from ropelab.evaluate.ruler_tasks import RULER_TASKS, largest_fitting

RULER_TASK_NAMES = tuple(RULER_TASKS)
_STREAM = 10  # seed streams 10, 11, ... per RULER task (passkey and needle use 1 and 2)
_PROBE = 64  # haystack units added to the smallest one to estimate the tokens per unit


@dataclass
class RulerItem:
    task: str
    length: int  # prompt + new tokens
    index: int
    prompt: np.ndarray  # token ids, ending with the answer prefix
    references: list[str]
    candidates: list[list[int]] = field(repr=False)  # token ids; candidates[0] is the true answer
    max_new_tokens: int
    haystack: int  # haystack size in the task's units

    @property
    def positions(self) -> int:
        """Positions the item needs: its prompt and the longer of its new tokens and its candidates."""
        return len(self.prompt) + max(self.max_new_tokens, *(len(c) for c in self.candidates))


def _first_guess(count, plan, budget: int) -> int:
    """A haystack size near the budget, from the tokens of the smallest haystack and of one _PROBE units larger."""
    small = count(plan.min_size)
    per_unit = (count(plan.min_size + _PROBE) - small) / _PROBE
    return plan.min_size + max(1, int((budget - small) / per_unit)) if per_unit > 0 else 2 * plan.min_size


def build_ruler_items(tokenizer, task: str, lengths: Sequence[int], items: int, seed: int,
                      distractors: int) -> list[RulerItem]:
    """`items` items of the RULER task `task` at every length (length-major, then item index)."""
    spec = RULER_TASKS[task]

    def tokens(text: str) -> list[int]:
        return tokenizer.encode_batch([text])[0]

    built = []
    for length in lengths:
        budget = length - spec.max_new_tokens
        guess = None
        for index in range(items):
            plan = spec.plan([seed, _STREAM + RULER_TASK_NAMES.index(task), length, index], length, distractors,
                             lambda text: len(tokens(text)))
            encoded: dict[int, tuple] = {}

            def count(size: int) -> int:
                if size not in encoded:
                    sample = plan.sample(size)
                    encoded[size] = (sample, tokens(sample.text))
                return len(encoded[size][1])

            size = largest_fitting(lambda n: n <= plan.max_size and count(n) <= budget, plan.min_size,
                                   guess or _first_guess(count, plan, budget))
            if size is None:
                raise ConfigError(
                    f"lengths: {length} tokens cannot hold a {task} prompt ({count(plan.min_size)} tokens with the "
                    f"smallest haystack) and its {spec.max_new_tokens} new tokens; use longer lengths"
                )
            if size == plan.max_size:
                raise ConfigError(f"lengths: {length} tokens need a {task} haystack beyond its {plan.max_size} "
                                  "distinct words; use shorter lengths")
            guess = size
            sample, prompt = encoded[size]
            built.append(RulerItem(task, length, index, np.asarray(prompt, dtype=np.int64), sample.references,
                                   tokenizer.encode_batch(sample.candidates), spec.max_new_tokens, size))
    return built
