"""RULER items at lengths counted in the model's own tokens.

As RULER does, a length is the whole sequence: the prompt (ending with the task's answer prefix)
plus the task's new tokens (128 for NIAH, 30 for vt, 120 for cwe, 50 for fwe). For each item the
haystack grows (in sentences, words or list entries, see `ropelab.evaluate.ruler_tasks`) to the
largest size whose prompt, encoded by the model's tokenizer, still leaves room for the new tokens:
the prompt falls short of length - new tokens by less than one haystack unit. An item depends only
on (seed, task, length, item index), the tokenizer and the essay haystack.

BOS: RULER's Hugging Face path encodes a prompt as the tokenizer does by default, so a tokenizer whose
post-processor puts a BOS token first (Llama 3's, for example) gets one and others (Qwen's, SmolLM2's,
ropelab's own) do not. Prompts here start with the tokens the tokenizer's default puts before a
text (`bos_prefix`), counted in the length (RULER counts the text's tokens only, so its prompts can
be one token longer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ropelab.errors import ConfigError
from ropelab.evaluate.ruler_essay import DEFAULT_HAYSTACK, essay_text
from ropelab.evaluate.ruler_tasks import ESSAY_TASKS, RULER_TASKS, largest_fitting

RULER_TASK_NAMES = tuple(RULER_TASKS)
_STREAM = 10  # seed streams 10, 11, ... per RULER task (passkey and needle use 1 and 2)
_PROBE = 64  # haystack units added to the smallest one to estimate the tokens per unit
_BOS_PROBE = "Hello"


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
    haystack_repeats: bool = False  # an essay haystack that holds some of its text twice

    @property
    def positions(self) -> int:
        """Positions the item needs: its prompt and the longer of its new tokens and its candidates."""
        return len(self.prompt) + max(self.max_new_tokens, *(len(c) for c in self.candidates))


def _first_guess(count, plan, budget: int) -> int:
    """A haystack size near the budget, from the tokens of the smallest haystack and of one _PROBE units larger."""
    small = count(plan.min_size)
    per_unit = (count(plan.min_size + _PROBE) - small) / _PROBE
    return plan.min_size + max(1, int((budget - small) / per_unit)) if per_unit > 0 else 2 * plan.min_size


def bos_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer's default encoding puts before a text (its BOS, if its post-processor adds
    one); [] for tokenizers without a post-processor of their own (bytes)."""
    backend = getattr(tokenizer, "tok", None)  # the tokenizers.Tokenizer of an HFTokenizer
    if backend is None:
        return []
    plain = backend.encode(_BOS_PROBE, add_special_tokens=False).ids
    full = backend.encode(_BOS_PROBE, add_special_tokens=True).ids
    return next((full[:k] for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), [])


def bos_description(tokenizer) -> str:
    """What RULER's prompts start with, for reports: "added by the tokenizer's default (<token>)" or "none"."""
    prefix = bos_prefix(tokenizer)
    if not prefix:
        return "none"
    return f"added by the tokenizer's default ({' '.join(tokenizer.tok.id_to_token(i) for i in prefix)})"


def build_ruler_items(tokenizer, task: str, lengths: Sequence[int], items: int, seed: int,
                      distractors: int, haystack: str = DEFAULT_HAYSTACK) -> list[RulerItem]:
    """`items` items of the RULER task `task` at every length (length-major, then item index); the
    essay tasks cut their haystacks from `haystack` (`ropelab.evaluate.ruler_essay.essay_text`)."""
    spec = RULER_TASKS[task]
    essay = essay_text(haystack) if task in ESSAY_TASKS else None
    prefix = bos_prefix(tokenizer)

    def tokens(text: str) -> list[int]:
        return prefix + tokenizer.encode_batch([text])[0]

    def plan_of(length: int, index: int):
        return spec.plan([seed, _STREAM + RULER_TASK_NAMES.index(task), length, index], length, distractors,
                         lambda text: len(tokens(text)), essay)

    def holding_length(length: int) -> int:
        """A length at which every item's smallest prompt leaves room for the new tokens. Items differ
        with the length, so the shortest prompt at one length says little about another."""
        while True:
            needed = max(len(tokens(plan.sample(plan.min_size).text)) + spec.max_new_tokens
                         for plan in (plan_of(length, index) for index in range(items)))
            if needed <= length:
                return length
            length = needed

    built = []
    for length in lengths:
        budget = length - spec.max_new_tokens
        guess = None
        for index in range(items):
            plan = plan_of(length, index)
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
                    f"smallest haystack) and its {spec.max_new_tokens} new tokens; use longer lengths, e.g. "
                    f"{holding_length(count(plan.min_size) + spec.max_new_tokens)}, which holds "
                    + (f"all {items} items" if items > 1 else "the item")
                )
            if size == plan.max_size:
                raise ConfigError(f"lengths: {length} tokens need a {task} haystack beyond its {plan.max_size} "
                                  "distinct words; use shorter lengths")
            guess = size
            sample, prompt = encoded[size]
            built.append(RulerItem(task, length, index, np.asarray(prompt, dtype=np.int64), sample.references,
                                   tokenizer.encode_batch(sample.candidates), spec.max_new_tokens, size, sample.repeats))
    return built
