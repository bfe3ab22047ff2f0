"""RULER's generators: every task hides its answers in a prompt that fills its length in tokens, as
RULER's templates and parameters say; items are a function of the seed. RULER's own behaviour is
the reference: its task table (fixtures/ruler/synthetic_tasks.yaml) and the prompts of its generator
scripts, values masked (fixtures/ruler/prompt_skeletons.json); common words past wonderwords' lists;
the BOS its Hugging Face path feeds; the shortest length a refusal suggests."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from tokenizers import processors

from ropelab.data.tokenizer import ByteTokenizer, HFTokenizer
from ropelab.errors import ConfigError
from ropelab.evaluate.ruler_items import RULER_TASK_NAMES, bos_description, bos_prefix, build_ruler_items
from ropelab.evaluate.ruler_tasks import (
    CWE_PROMPT, NEEDLE, RULER_TASKS, CommonWords, FrequentWords, Niah, VariableTracking, largest_fitting, niah_prompt,
)
from ropelab.evaluate.ruler_text import NOISE, common_words, more_common_words, word_list

from tests.evaluate.ruler_skeleton import skeleton

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
RULER_TABLE = yaml.safe_load((FIXTURES / "synthetic_tasks.yaml").read_text())
SKELETONS = json.loads((FIXTURES / "prompt_skeletons.json").read_text())["tasks"]

BYTES = ByteTokenizer()  # one token per byte: lengths below are in bytes
LENGTHS = {"vt": (2500, 4000), "cwe": (2000, 3500)}  # vt's worked example alone is about 900 bytes
SLACK = 150  # tokens a prompt may fall short of its budget: one haystack unit (a needle with two UUIDs: 120)


def items_of(task: str, seed: int = 0, items: int = 2, lengths=None):
    return build_ruler_items(BYTES, task, lengths or LENGTHS.get(task, (1200, 3000)), items, seed, distractors=5)


def text(item) -> str:
    return BYTES.decode(item.prompt.tolist())


@pytest.mark.parametrize("task", RULER_TASK_NAMES)
def test_every_task_hides_its_answers_and_fills_its_length(task):
    for item in items_of(task):
        prompt = text(item)
        gap = item.length - item.max_new_tokens - len(item.prompt)
        assert 0 <= gap <= SLACK, (item.length, gap)
        assert item.references and all(ref in prompt for ref in item.references)
        candidates = [BYTES.decode(c) for c in item.candidates]
        assert len(candidates) == 6 and len(set(candidates)) == 6
        assert all(ref in candidates[0] for ref in item.references)
        assert not any(set(item.references) <= set(re.findall(r"[\w-]+", c)) for c in candidates[1:])
        assert item.positions <= item.length


@pytest.mark.parametrize("task", RULER_TASK_NAMES)
def test_items_depend_on_the_seed_only(task):
    a, b, c = items_of(task), items_of(task), items_of(task, seed=1)
    assert [text(x) for x in a] == [text(y) for y in b] and [x.candidates for x in a] == [y.candidates for y in b]
    assert all(text(x) != text(z) and x.references != z.references for x, z in zip(a, c))
    assert a[0].references != a[1].references  # items of one length differ too


def ruler_arguments(task) -> tuple[str, dict]:
    """The base task and arguments RULER's synthetic.yaml would give `task`."""
    if isinstance(task, Niah):
        return "niah", {"type_haystack": task.haystack, "type_needle_k": task.key_kind, "type_needle_v": task.value_kind,
                        "num_needle_k": task.keys, "num_needle_v": task.values, "num_needle_q": task.queries}
    if isinstance(task, VariableTracking):
        return "variable_tracking", {"type_haystack": "noise", "num_chains": task.chains, "num_hops": task.hops}
    if isinstance(task, CommonWords):
        return "common_words_extraction", {"freq_cw": task.freq_cw, "freq_ucw": task.freq_ucw, "num_cw": task.num_cw}
    assert isinstance(task, FrequentWords)
    return "freq_words_extraction", {"alpha": task.alpha}


def test_task_table_is_ruler_s_synthetic_yaml():
    assert RULER_TASK_NAMES == tuple(RULER_TABLE["tasks"])  # RULER's 11 synthetic tasks, in its order
    for name, task in RULER_TASKS.items():
        base, arguments = ruler_arguments(task)
        assert {"task": base, "args": arguments} == RULER_TABLE["tasks"][name], name
        assert task.max_new_tokens == RULER_TABLE["base_tasks"][base]["tokens_to_generate"], name


def prompt_of(task: str, length: int, seed: int = 0) -> str:
    (item,) = items_of(task, seed, items=1, lengths=(length,))
    return text(item)


@pytest.mark.parametrize("task, length", [("niah_single_1", 3000), ("niah_multikey_2", 3000), ("niah_multikey_3", 4000),
                                          ("vt", 4000), ("cwe", 9000), ("fwe", 3000)])
def test_prompts_match_the_skeletons_of_ruler_s_generator(task, length):
    expected = SKELETONS[task]
    for seed in (0, 1):
        assert skeleton(prompt_of(task, length, seed)) == (expected["skeleton"], expected["noise_lines"])


def test_niah_template_singular_and_plural_read_as_ruler_s():
    assert niah_prompt("numbers", True, "CTX", "red-fox") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the number afterwards.\nCTX\nWhat is the special magic number for red-fox mentioned in the provided "
        "text? The special magic number for red-fox mentioned in the provided text is")
    assert niah_prompt("uuids", False, "CTX", "a, b, and c") == (
        "Some special magic uuids are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the uuids afterwards.\nCTX\nWhat are all the special magic uuids for a, b, and c mentioned in the "
        "provided text? The special magic uuids for a, b, and c mentioned in the provided text are")


def needles(prompt: str, kind: str = "numbers") -> list[tuple[str, str]]:
    """(key, value) of every needle in a prompt."""
    pattern = re.escape(NEEDLE.format(kind=kind, key="KEY", value="VALUE")).replace("KEY", r"(\S+)").replace("VALUE", r"(\S+?)")
    return re.findall(pattern + r"(?=\s|$)", prompt)


def test_niah_variants_hold_ruler_s_needles():
    (single,) = items_of("niah_single_1", items=1, lengths=(1500,))
    assert needles(text(single)) == [(re.search(r"number for (.+?) mentioned", text(single))[1], single.references[0])]
    assert text(single).count(NOISE) >= 10 and re.fullmatch(r"\d{7}", single.references[0])
    (multikey,) = items_of("niah_multikey_1", items=1, lengths=(1500,))
    found = needles(text(multikey))
    asked = re.search(r"number for (.+?) mentioned", text(multikey))[1]
    assert len(found) == 4 and dict(found)[asked] == multikey.references[0]
    (multivalue,) = items_of("niah_multivalue", items=1, lengths=(1500,))
    found = needles(text(multivalue))
    assert len(found) == 4 and len({key for key, _ in found}) == 1 and sorted(v for _, v in found) == sorted(multivalue.references)
    (multiquery,) = items_of("niah_multiquery", items=1, lengths=(1500,))
    keys = re.search(r"numbers for (.+?), (.+?), (.+?), and (.+?) mentioned", text(multiquery)).groups()
    assert {dict(needles(text(multiquery)))[k] for k in keys} == set(multiquery.references)
    (haystack_of_needles,) = items_of("niah_multikey_3", items=1, lengths=(3000,))
    found = needles(text(haystack_of_needles), "uuids")
    assert len(found) > 10 and all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
                                   for pair in found for v in pair)
    (uuid_item,) = items_of("niah_single_3", items=1, lengths=(1500,))
    assert "special magic uuid for" in text(uuid_item) and len(uuid_item.references[0]) == 36


def test_variable_tracking_chain_and_worked_example():
    (item,) = items_of("vt", items=1, lengths=(4000,))
    prompt = text(item)
    assert prompt.count("Memorize and track the chain(s) of variable assignment") == 2  # the example, then the task
    task = prompt.rsplit("Memorize and track", 1)[1]
    value = re.search(r"assigned the value (\d{5}) in the text above", task)[1]
    names = item.references
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    assert f"VAR {names[0]} = {value}" in task
    assert all(f"VAR {names[j + 1]} = VAR {names[j]} " in task for j in range(4))
    assert task.endswith(f"5 variables are assigned the value {value}, they are: ")
    example = prompt.split("they are: ", 1)[1].split("\n", 1)[0].split()
    assert len(example) == 5 and all(re.fullmatch(r"[A-Z]{3}", n) for n in example)


@pytest.mark.parametrize("length, repeats", [(3500, (6, 1)), (9000, (30, 3))])
def test_common_words_repeat_as_ruler_s(length, repeats):
    (item,) = items_of("cwe", items=1, lengths=(length,))
    prompt = text(item)
    assert prompt.count("Below is a numbered list of words.") == 2 and prompt.endswith(CWE_PROMPT.rsplit("}", 1)[1])
    listed = re.findall(r"\d+\. (\S+)", prompt.rsplit("Below is a numbered list", 1)[1].split("\nQuestion")[0])
    counts = Counter(listed)
    assert {w for w, c in counts.items() if c == repeats[0]} == set(item.references)
    assert all(counts[w] == repeats[1] for w in counts if w not in item.references)
    vocabulary = set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb"))
    assert set(counts) <= vocabulary


def test_frequent_words_follow_a_zeta_distribution():
    (item,) = items_of("fwe", items=1, lengths=(3000,))
    coded = text(item).split("coded words. ", 1)[1].split("\nQuestion")[0].split()
    ranked = [w for w, _ in Counter(coded).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == item.references
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    counts = Counter(coded)
    assert counts["..."] / counts[ranked[1]] == pytest.approx(4, rel=0.05)  # k^-2 at ranks 1, 2 and 3
    assert counts[ranked[1]] / counts[ranked[2]] == pytest.approx(9 / 4, rel=0.05)


def test_largest_fitting_finds_the_boundary_from_any_guess():
    for limit in (0, 1, 7, 100, 1000):
        for guess in (0, 3, 50, 5000):
            assert largest_fitting(lambda n: n <= limit, 0, guess) == limit
    assert largest_fitting(lambda n: n <= 4, 5, 10) is None


def test_a_length_too_short_for_a_task_is_one_clear_error():
    with pytest.raises(ConfigError, match="lengths: 1000 tokens cannot hold a vt prompt"):
        build_ruler_items(BYTES, "vt", (1000,), 1, 0, 3)
    with pytest.raises(ConfigError, match="cannot hold a niah_single_1 prompt"):
        build_ruler_items(BYTES, "niah_single_1", (300,), 1, 0, 3)


def test_candidates_rank_the_true_answer_against_answers_of_its_form():
    (item,) = items_of("niah_multikey_2", items=1, lengths=(3000,))
    prompt = text(item)
    wrong = [BYTES.decode(c).strip() for c in item.candidates[1:]]
    assert all(re.fullmatch(r"\d{7}", w) and f"is: {w}." in prompt for w in wrong)  # other needles' values
    (item,) = items_of("niah_multivalue", items=1, lengths=(1500,))
    true = BYTES.decode(item.candidates[0])
    assert sorted(true.strip().split(", ")) == sorted(item.references)
    positions = [text(item).index(v) for v in true.strip().split(", ")]
    assert positions == sorted(positions)  # in the order the prompt holds them
    assert np.all([len(BYTES.decode(c).split(", ")) == 4 for c in item.candidates])


def test_common_words_past_wonderwords_come_from_the_second_list_as_ruler_s_do():
    first, second = common_words(), more_common_words()
    assert len(first) == 8166 and len(second) == 234_450 and all(re.fullmatch(r"[a-z]+", w) for w in second)
    (item,) = items_of("cwe", items=1, lengths=(480_000,))  # past the 8,166 words of the first list
    listed = re.findall(r"\d+\. (\S+)", text(item).rsplit("Below is a numbered list", 1)[1].split("\nQuestion")[0])
    counts = Counter(listed)
    assert item.haystack == len(counts) > len(first) and item.length - item.max_new_tokens - len(item.prompt) < 150
    assert set(counts) <= set(second) and not set(counts) <= set(first)  # every word from the second list
    assert {w for w, c in counts.items() if c == 30} == set(item.references) and set(counts.values()) == {30, 3}
    (below,) = items_of("cwe", items=1, lengths=(400_000,))  # the first list holds all it needs
    assert below.haystack <= len(first) and set(below.references) <= set(first)


def byte_tokenizer(bos: bool) -> HFTokenizer:
    """ropelab's byte tokenizer as a `tokenizers.Tokenizer`, with a post-processor putting <|bos|> first or none."""
    backend = ByteTokenizer().to_tokenizers()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 257)])
    return HFTokenizer(backend, "bytes+bos" if bos else "bytes")


@pytest.mark.parametrize("task", ["niah_single_1", "vt"])
def test_prompts_start_with_the_bos_the_tokenizer_adds_by_default(task):
    with_bos, without = byte_tokenizer(True), byte_tokenizer(False)
    assert bos_prefix(with_bos) == [257] and bos_description(with_bos) == "added by the tokenizer's default (<|bos|>)"
    assert bos_prefix(without) == bos_prefix(BYTES) == [] and bos_description(without) == "none"
    length = LENGTHS.get(task, (1200,))[0]
    for item in build_ruler_items(with_bos, task, (length,), 2, 0, 5):
        assert item.prompt[0] == 257 and 257 not in item.prompt[1:] and len(item.prompt) + item.max_new_tokens <= length
        assert with_bos.decode(item.prompt[1:].tolist()).startswith(("A special magic", "Memorize and track"))
    assert all(item.prompt[0] != 257 for item in build_ruler_items(without, task, (length,), 2, 0, 5))


def test_the_length_a_refusal_suggests_is_accepted():
    for task, items in (("niah_single_1", 1), ("niah_multikey_1", 3), ("niah_multivalue", 3), ("cwe", 2)):
        with pytest.raises(ConfigError) as refusal:
            build_ruler_items(BYTES, task, (300,), items, 0, 3)
        message = str(refusal.value)
        smallest, new = map(int, re.search(r"\((\d+) tokens with the smallest haystack\) and its (\d+) new", message).groups())
        suggested = int(re.search(r"use longer lengths, e\.g\. (\d+), which holds", message)[1])
        assert suggested >= smallest + new
        assert len(build_ruler_items(BYTES, task, (suggested,), items, 0, 3)) == items
    # items change with the length, so the smallest prompt at 300 tokens plus the new tokens, the length
    # the message used to imply, is refused here (the other items at that length are longer)
    with pytest.raises(ConfigError, match="lengths: 714 tokens cannot hold a niah_multikey_1 prompt"):
        build_ruler_items(BYTES, "niah_multikey_1", (586 + 128,), 3, 0, 3)
