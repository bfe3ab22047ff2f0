"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654) with RULER's names, parameters and prompts.

  niah_single_1/2/3          one needle, "One of the special magic numbers for <key> is: <value>.",
                             in noise / essay / essay, values 7-digit numbers / numbers / UUIDs (the
                             essay haystack: `ropelab.evaluate.ruler_essay`);
  niah_multikey_1/2/3        the queried needle among 3 more needles in an essay, or in a haystack made
                             only of needles (keys words / UUIDs, values numbers / UUIDs);
  niah_multivalue            one key holding 4 values; niah_multiquery: 4 keys asked at once;
  vt                         variable tracking: a chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops)
                             in noise, after one worked example of about 500 tokens; find every name;
  cwe                        common words: a numbered list where 10 words come 30 times and the rest
                             3 times (6 and 1 below 4,096 tokens), after one worked example; the words
                             come from wonderwords' lists, or all from a second, larger English list
                             when the list needs more distinct words than those hold (as RULER does);
  fwe                        frequent words: coded words drawn from a Zeta(2) distribution (the most
                             frequent one is "..." noise); name the three next most frequent.

A task gives, for an item's seed, a `Plan`: a function of the haystack size (sentences, words, list
entries or coded words) that returns the whole prompt (instruction, context, question and RULER's
answer prefix, which ends the prompt), the references the output is scored against, whether an essay
haystack repeats its text, and answer
candidates for the log-likelihood rank: the true one (the references in the order they occur in the
prompt) and wrong ones of the same form, taken from the prompt where it holds such values (the other
needles' values, the less common words) and drawn at random otherwise. Everything but the haystack
size comes from the seed, so `ropelab.evaluate.ruler_items` can grow the haystack until the prompt
fills its length.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
from scipy.special import zeta

from ropelab.evaluate.ruler_essay import EssayText
from ropelab.evaluate.ruler_text import (
    DEPTHS, NOISE, common_words, distinct_names, distinct_values, insert_lines, more_common_words,
)

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_EXAMPLE_TOKENS = 500  # RULER's worked example for variable tracking fills this many tokens


@dataclass
class Sample:
    text: str  # the whole prompt, ending with RULER's answer prefix
    references: list[str]  # scored against the output (string_match_all)
    candidates: list[str]  # continuations ranked by log-likelihood; [0] is the true one
    repeats: bool = False  # an essay haystack that needed more words than its text has


@dataclass
class Plan:
    sample: Callable[[int], Sample]  # haystack size -> sample
    min_size: int
    max_size: int = 10**9


def largest_fitting(fits: Callable[[int], bool], low: int, guess: int) -> Optional[int]:
    """The largest size n >= `low` with fits(n) true and fits(n + 1) false, searched from `guess`
    (gallop, then bisect); None when fits(low) is false. Sizes are tried once each."""
    tried: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = fits(n)
        return tried[n]

    if not ok(low):
        return None
    guess, step = max(low, guess), max(1, guess // 32)
    if ok(guess):
        lo = guess
        while ok(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi = guess
        while not ok(max(low, hi - step)):
            hi, step = max(low, hi - step), step * 2
        lo = max(low, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def rng_of(seed: list[int], stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([*seed, stream, *more])


def _wrong_candidates(rng, pool: list[str], fresh: Callable[[int], list[str]], width: int, count: int,
                      render: Callable[[list[str]], str]) -> list[str]:
    """`count` wrong answers of `width` values each: `pool` values (shuffled) first, then `fresh` ones."""
    values = [pool[i] for i in rng.permutation(len(pool))]
    values += fresh(max(0, width * count - len(values)))
    return [render(values[k * width : (k + 1) * width]) for k in range(count)]


def _in_order(text: str, values: list[str]) -> list[str]:
    return sorted(values, key=text.find)


# ------------------------------------------------------------------ needle in a haystack


@dataclass(frozen=True)
class Niah:
    haystack: str  # "noise", "essay" or "needle" (a haystack of needles with other keys)
    key_kind: str  # "words", "numbers" or "uuids"
    value_kind: str
    keys: int = 1
    values: int = 1
    queries: int = 1
    max_new_tokens: int = 128

    def plan(self, seed: list[int], length: int, distractors: int, count_tokens, essay: Optional[EssayText]) -> Plan:
        rng = rng_of(seed, 0)
        n_keys = max(self.keys, self.queries)
        keys = distinct_values(rng, self.key_kind, n_keys)
        values = [distinct_values(rng, self.value_kind, self.values) for _ in keys]
        needles = [NEEDLE.format(kind=self.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        needles = [needles[i] for i in rng.permutation(len(needles))]
        asked = [int(i) for i in rng.choice(n_keys, self.queries, replace=False)]
        references = [v for i in asked for v in values[i]]
        query = keys[asked[0]] if len(asked) == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
        used = frozenset(keys) | frozenset(v for vs in values for v in vs)
        singular = self.queries * self.values == 1

        def sample(size: int) -> Sample:
            context, others = self._context(seed, size, needles, used, essay)
            others += [v for i, vs in enumerate(values) if i not in asked for v in vs]
            text = niah_prompt(self.value_kind, singular, context, query)
            true = _in_order(text, references)
            fresh = lambda n: distinct_values(rng_of(seed, 4), self.value_kind, n, used)  # noqa: E731
            wrong = _wrong_candidates(rng_of(seed, 3), others, fresh, len(true), distractors, lambda vs: " " + ", ".join(vs))
            repeats = self.haystack == "essay" and essay.repeats(size)
            return Sample(text, references, [" " + ", ".join(true), *wrong], repeats)

        return Plan(sample, min_size=len(needles))

    def _context(self, seed: list[int], size: int, needles: list[str], used: frozenset[str],
                 essay: Optional[EssayText]) -> tuple[str, list[str]]:
        """The haystack of `size` sentences (noise, needles) or words (of `essay`) with the needles in it,
        and the values of the haystack's own needles."""
        if self.haystack == "essay":
            sentences = essay.sentences(essay.start(rng_of(seed, 1)), size)
            depths = rng_of(seed, 2).choice(DEPTHS, len(needles), replace=False)
            cuts = [0, *sorted(int(len(sentences) * d / 100) for d in depths), len(sentences)]
            pieces = []
            for k in range(len(cuts) - 1):
                pieces += sentences[cuts[k] : cuts[k + 1]]
                if k < len(needles):
                    pieces.append(needles[k])
            return " ".join(pieces), []
        others: list[str] = []
        if self.haystack == "noise":
            lines = [NOISE] * size
        else:
            fake_keys = distinct_values(rng_of(seed, 1), self.key_kind, size, used)
            others = distinct_values(rng_of(seed, 6), self.value_kind, size, used)
            lines = [NEEDLE.format(kind=self.value_kind, key=k, value=v) for k, v in zip(fake_keys, others)]
        return "\n".join(insert_lines(lines, needles, rng_of(seed, 2))), others


def niah_prompt(kind: str, singular: bool, context: str, query: str) -> str:
    """RULER's NIAH template with its answer prefix, in the singular when one value is asked for."""
    some, be, what_be = ("A", "is", "is") if singular else ("Some", "are", "are all")
    kind = kind[:-1] if singular else kind
    return (f"{some} special magic {kind} {be} hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n{context}\n"
            f"What {what_be} the special magic {kind} for {query} mentioned in the provided text? "
            f"The special magic {kind} for {query} mentioned in the provided text {be}")


# ------------------------------------------------------------------ variable tracking


@dataclass(frozen=True)
class VariableTracking:
    chains: int = 1
    hops: int = 4
    max_new_tokens: int = 30

    def _chains(self, rng, letters: int) -> tuple[list[list[str]], list[list[str]], str]:
        names = distinct_names(rng, (self.hops + 1) * self.chains, letters)
        groups = [names[c * (self.hops + 1) : (c + 1) * (self.hops + 1)] for c in range(self.chains)]
        values = [str(int(rng.integers(10000, 99999))) for _ in groups]
        lines = [[f"VAR {g[0]} = {v}"] + [f"VAR {g[j + 1]} = VAR {g[j]} " for j in range(self.hops)]
                 for g, v in zip(groups, values)]
        return groups, lines, values[0]

    def _body(self, seed: list[int], size: int, lines: list[list[str]], value: str) -> str:
        noise = [NOISE] * size
        rng = rng_of(seed, 2, size)
        for chain in lines:
            noise = insert_lines(noise, chain, rng)
        context = "\n".join(noise).replace(". \n", ".\n")
        return ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                f"{context}\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                f"Answer: According to the chain(s) of variable assignment in the text above, {self.hops + 1} "
                f"variables are assigned the value {value}, they are: ")

    def plan(self, seed: list[int], length: int, distractors: int, count_tokens, essay: Optional[EssayText]) -> Plan:
        example_seed = [*seed, 5]
        ex_groups, ex_lines, ex_value = self._chains(rng_of(example_seed, 0), 3)
        min_size = (self.hops + 1) * self.chains
        size = largest_fitting(lambda n: count_tokens(self._body(example_seed, n, ex_lines, ex_value)) <= VT_EXAMPLE_TOKENS,
                               min_size, 8) or min_size  # a tokenizer too wordy for 500 tokens: the smallest example
        example = self._body(example_seed, size, ex_lines, ex_value) + " " + " ".join(ex_groups[0]) + "\n"
        groups, lines, value = self._chains(rng_of(seed, 0), 5)
        names = frozenset(n for g in groups for n in g)

        def sample(size: int) -> Sample:
            text = example + "\n" + self._body(seed, size, lines, value)
            wrong = [" " + " ".join(distinct_names(rng_of(seed, 3, k), self.hops + 1, 5, avoid=names))
                     for k in range(distractors)]
            return Sample(text, list(groups[0]), [" " + " ".join(groups[0]), *wrong])

        return Plan(sample, min_size=min_size)


# ------------------------------------------------------------------ common words extraction


CWE_PROMPT = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words "
              "in the above list? Answer: The top 10 words that appear most often in the list are:")


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass(frozen=True)
class CommonWords:
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    max_new_tokens: int = 120

    def _shuffled(self, rng, words: list[str], repeats: tuple[int, int]) -> list[str]:
        """The list's entries: the first `num_cw` words `repeats[0]` times, the others `repeats[1]` times."""
        entries = words[: self.num_cw] * repeats[0] + words[self.num_cw :] * repeats[1]
        return [entries[i] for i in rng.permutation(len(entries))]

    def plan(self, seed: list[int], length: int, distractors: int, count_tokens, essay: Optional[EssayText]) -> Plan:
        pool = common_words()
        short = length < 4096  # RULER's lighter repeats for short contexts
        example_words = [pool[i] for i in rng_of(seed, 5).choice(len(pool), 20 if short else 40, replace=False)]
        example_list = self._shuffled(rng_of(seed, 6), example_words, (3, 1) if short else (10, 3))
        example = CWE_PROMPT.format(context=numbered(example_list)) + " " + numbered(example_words[: self.num_cw])
        repeats = (6, 1) if short else (self.freq_cw, self.freq_ucw)

        orders: dict[int, tuple[list[str], np.ndarray]] = {}

        def source_order(size: int) -> tuple[list[str], np.ndarray]:
            """The list a haystack of `size` words draws from (the second one past wonderwords') and its
            seeded order, each shuffled once per plan."""
            stream = 0 if size <= len(pool) else 7
            if stream not in orders:
                source = pool if stream == 0 else more_common_words()
                orders[stream] = source, rng_of(seed, stream).permutation(len(source))
            return orders[stream]

        def sample(size: int) -> Sample:
            source, order = source_order(size)
            words = [source[i] for i in order[:size]]
            entries = self._shuffled(rng_of(seed, 2, size), words, repeats)
            text = example + "\n" + CWE_PROMPT.format(context=numbered(entries))
            references = words[: self.num_cw]
            true = sorted(references, key=entries.index)
            wrong = _wrong_candidates(rng_of(seed, 3), words[self.num_cw :], lambda n: [source[i] for i in order[size : size + n]],
                                      self.num_cw, distractors, lambda vs: " " + numbered(vs))
            return Sample(text, references, [" " + numbered(true), *wrong])

        return Plan(sample, min_size=self.num_cw + 1, max_size=len(more_common_words()))


# ------------------------------------------------------------------ frequent words extraction


FWE_PROMPT = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
              "the dots '....'. What are the three most frequently appeared words in the above coded text? "
              "Answer: According to the coded text above, the three most frequently appeared words are:")


@dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    word_length: int = 6
    max_new_tokens: int = 50

    def plan(self, seed: list[int], length: int, distractors: int, count_tokens, essay: Optional[EssayText]) -> Plan:
        vocab_size = max(8, (length - self.max_new_tokens) // 50)  # RULER: the budget // 50
        vocab = ["..."] + distinct_names(rng_of(seed, 0), vocab_size - 1, self.word_length, string.ascii_lowercase)
        rank_weight = np.arange(1, vocab_size + 1, dtype=np.float64) ** -self.alpha / zeta(self.alpha)
        references = vocab[1:4]

        def sample(size: int) -> Sample:
            counts = (size * rank_weight).astype(int)
            words = [w for w, c in zip(vocab, counts) for _ in range(c)]
            text = FWE_PROMPT.format(context=" ".join(words[i] for i in rng_of(seed, 2, size).permutation(len(words))))
            seen = [w for w, c in zip(vocab[4:], counts[4:]) if c]
            wrong = _wrong_candidates(rng_of(seed, 3), seen, lambda n: distinct_names(rng_of(seed, 4), n, self.word_length,
                                      string.ascii_lowercase, frozenset(vocab)), 3, distractors, lambda vs: " " + ", ".join(vs))
            return Sample(text, list(references), [" " + ", ".join(references), *wrong])

        return Plan(sample, min_size=int(np.ceil(1 / rank_weight[3])))


RulerTask = Union[Niah, VariableTracking, CommonWords, FrequentWords]
RULER_TASKS: dict[str, RulerTask] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}
ESSAY_TASKS = tuple(name for name, task in RULER_TASKS.items() if isinstance(task, Niah) and task.haystack == "essay")
