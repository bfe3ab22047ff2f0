"""RULER's generators: every task hides its answers in a prompt that fills its length in tokens, as
RULER's templates and parameters say; items are a function of the seed."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from ropelab.data.tokenizer import ByteTokenizer
from ropelab.errors import ConfigError
from ropelab.evaluate.ruler_items import RULER_TASK_NAMES, build_ruler_items
from ropelab.evaluate.ruler_tasks import CWE_PROMPT, NEEDLE, RULER_TASKS, largest_fitting, niah_prompt
from ropelab.evaluate.ruler_text import NOISE, essay_sentences, essay_words, prose_paragraphs, word_list

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


def test_max_new_tokens_are_ruler_s():
    assert {name: task.max_new_tokens for name, task in RULER_TASKS.items()} == {
        **{name: 128 for name in RULER_TASK_NAMES if name.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50}


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


def test_essay_haystack_is_prose_from_the_built_in_corpus():
    (item,) = items_of("niah_single_2", items=1, lengths=(1500,))
    prompt = text(item)
    context = prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat is", 1)[0]
    assert context[0].isupper() and len(context.split()) > 100 and NOISE not in prompt
    pool = " ".join(essay_words())
    first_words = " ".join(context.split()[:8])
    assert first_words in pool and len(essay_words()) >= 25_000
    assert prose_paragraphs(">>> f(1)\n1\n\nShort.\n\nThis paragraph is long enough to count as prose, and it ends "
                            "with a full stop as sentences do.") == [
        "This paragraph is long enough to count as prose, and it ends with a full stop as sentences do."]
    assert essay_sentences(0, 40)[0][0].isupper()


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
