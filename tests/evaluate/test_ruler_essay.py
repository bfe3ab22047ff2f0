"""The essay haystack of RULER's essay tasks: wiki-prose articles in order from a seeded start (the
default), stdlib-prose as before, RULER's own PaulGrahamEssays.json from its first word; a haystack
that runs out of text repeats it and says so; a bad file is one line naming it."""

from __future__ import annotations

import json
import re

import pytest

from ropelab.config import ConfigError
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.data.wiki import wiki_articles
from ropelab.evaluate.longctx_items import items_fingerprint
from ropelab.evaluate.ruler_essay import check_haystack, essay_text, prose_paragraphs
from ropelab.evaluate.ruler_items import build_ruler_items
from ropelab.evaluate.ruler_tasks import ESSAY_TASKS, NEEDLE

BYTES = ByteTokenizer()  # one token per byte


def haystack_words(item) -> list[str]:
    """The words of an essay item's haystack, its needles taken out."""
    prompt = BYTES.decode(item.prompt.tolist())
    context = prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]
    needle = re.escape(NEEDLE).replace(r"\{kind\}", r"\w+").replace(r"\{key\}", r"\S+").replace(r"\{value\}", r"\S+")
    return re.sub(needle, " ", context).split()


def test_the_essay_tasks_are_ruler_s_five():
    assert ESSAY_TASKS == ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


def test_default_haystack_is_wiki_prose_articles_in_order_from_a_seeded_start():
    essay = essay_text()
    articles = wiki_articles("wiki-prose")
    assert essay.name == "wiki-prose" and "CC BY-SA 4.0" in essay.description
    assert len(essay.starts) == len(articles) and essay.words == tuple(w for _, t in articles for w in t.split())
    starts = set()
    for seed in (0, 1):
        for item in build_ruler_items(BYTES, "niah_single_2", (1500, 3000), 2, seed, 5):
            words = haystack_words(item)
            start = next(s for s in essay.starts if list(essay.words[s : s + 12]) == words[:12])  # an article's first words
            assert words == list(essay.words[start : start + len(words)])  # the articles that follow, in title order
            assert not item.haystack_repeats
            starts.add(start)
    assert len(starts) >= 6  # the start depends on the seed, the length and the item


def test_stdlib_prose_keeps_the_haystacks_of_before():
    fingerprints = {task: items_fingerprint(build_ruler_items(BYTES, task, (1500, 3000), 2, 0, 5, "stdlib-prose"))
                    for task in ("niah_single_2", "niah_multikey_1", "niah_multivalue")}
    # items of the commit before wiki-prose became the default (f4c9b97), same arguments
    assert fingerprints == {"niah_single_2": "faf7052d1ce25d7b", "niah_multikey_1": "c91ce5f684430367",
                            "niah_multivalue": "12f196ce72bd95f6"}
    essay = essay_text("stdlib-prose")
    assert len(essay.words) >= 25_000 and essay.sentences(0, 40)[0][0].isupper()
    assert prose_paragraphs(">>> f(1)\n1\n\nShort.\n\nThis paragraph is long enough to count as prose, and it ends "
                            "with a full stop as sentences do.") == [
        "This paragraph is long enough to count as prose, and it ends with a full stop as sentences do."]


def essay_file(tmp_path, words: int) -> str:
    """A file in the form of RULER's PaulGrahamEssays.json: {"text": the essays concatenated}."""
    sentences = [f"Essay sentence number {k} says something plain about startups." for k in range(words // 8 + 1)]
    path = tmp_path / "PaulGrahamEssays.json"
    path.write_text(json.dumps({"text": "\n\n".join(sentences[: len(sentences) // 2]) + "\n" + " ".join(sentences[len(sentences) // 2 :])}))
    return str(path)


def test_ruler_s_essay_file_is_read_from_its_first_word_as_ruler_reads_it(tmp_path):
    path = essay_file(tmp_path, 4000)
    essay = essay_text(path)
    text = json.loads(open(path).read())["text"]
    assert essay.words == tuple(re.sub(r"\s+", " ", text).split(" ")) and essay.starts == (0,)  # RULER's split
    for item in build_ruler_items(BYTES, "niah_multikey_1", (1500, 2500), 2, 3, 5, path):
        words = haystack_words(item)
        assert words == list(essay.words[: len(words)]) and not item.haystack_repeats  # always the first words


def test_a_haystack_past_its_text_goes_on_from_the_start_and_says_it_repeats(tmp_path):
    path = essay_file(tmp_path, 100)
    essay = essay_text(path)
    (item,) = build_ruler_items(BYTES, "niah_single_3", (2500,), 1, 0, 5, path)
    words = haystack_words(item)
    assert item.haystack_repeats and len(words) > 2 * len(essay.words)
    assert words == [essay.words[k % len(essay.words)] for k in range(len(words))]  # as RULER repeats its essays
    assert essay.repeats(len(essay.words) + 1) and not essay.repeats(len(essay.words))


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"), (b"\xff\xfe not text", "not a JSON file"), (b"{\"text\": ", "not a JSON file"),
    (b"[\"a list\"]", 'needs a "text" field'), (b"{\"essays\": \"x\"}", 'needs a "text" field'),
    (b"{\"text\": \"  \"}", 'needs a "text" field'),
])
def test_a_bad_essay_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "essays.json"
    if content is None:
        path.mkdir()  # exists, but is no file to read
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        essay_text(str(path))
    assert str(error.value).startswith(f"haystack={path}: ") and "\n" not in str(error.value)


def test_an_unknown_haystack_name_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="haystack=wiki: not a built-in haystack nor a file; use wiki-prose, "
                                          "stdlib-prose or the path of RULER's PaulGrahamEssays.json"):
        check_haystack("wiki")
    for accepted in ("wiki-prose", "stdlib-prose", essay_file(tmp_path, 50)):
        check_haystack(accepted)
