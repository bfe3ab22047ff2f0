"""The English LAMBADA-like task `lambada_wiki`: the rule on a small article, the shipped items checked
against the rule and against the `wiki-prose` split, the generator deterministic and true to the shipped
file, and lm-eval's loader on the YAML."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from ropelab.data.corpus import in_validation
from ropelab.data.wiki import PACKAGE
from ropelab.evaluate.lambada_wiki import (CONTEXT_CHARS, CORPUS, COUNT, STOP_WORDS, article_items, main, sample_items,
                                           sentence_starts)
from ropelab.evaluate.task_generators import LastWordItem, corpus_split
from tests.evaluate.local_tasks import SHIPPED, load_shipped_task

needs_wiki = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None, reason="wiki-prose needs the prose extra")

ARTICLE = ("The river Elbe rises in the Giant Mountains. Dr. J. R. Smith mapped the Elbe's delta and the river's "
           "mouth for the U.S. Navy. Boats on the river carry coal to the sea. The coal comes from the mountains.")


def test_sentences_end_at_marks_but_not_at_initials_or_abbreviations():
    starts = sentence_starts(ARTICLE)
    assert [ARTICLE[s:s + 5] for s in starts] == ["The r", "Dr. J", "Boats", "The c"]
    assert sentence_starts("One.\nTwo? Three! (Four.) 5 is five.") == [0, 5, 10, 17, 25]


def test_rule_on_a_small_article():
    head = ARTICLE[:ARTICLE.index(" Boats")]  # the first two sentences
    assert article_items("Elbe", ARTICLE) == [
        # "Elbe's" and "river's" are no whole words; "Navy" and "Boats" are nowhere earlier; "the" is a stop word
        LastWordItem(head + " Boats on the", " river", "Elbe:3"),
        LastWordItem(head + " Boats on the river carry coal to the sea. The", " coal", "Elbe:4"),
        LastWordItem(head + " Boats on the river carry coal to the sea. The coal comes from the", " mountains", "Elbe:4"),
    ]  # "Mountains" counts for " mountains" (case is ignored); the second "the" is a stop word
    # in 60 characters only the third sentence fits before "coal"; "Mountains" and "river" are further back
    third = "Boats on the river carry coal to the sea. The"  # 45 characters
    assert article_items("Elbe", ARTICLE, context_chars=60) == [LastWordItem(third, " coal", "Elbe:4")]
    assert article_items("Elbe", ARTICLE, context_chars=44) == []
    assert article_items("Elbe", "A word and a word.") == []  # the last sentence alone gives it away
    assert article_items("Elbe", "The word Sea. Sea water.") == []  # a sentence's first word is never a target


def _word(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


@pytest.fixture(scope="module")
def split():
    return corpus_split(CORPUS)


@needs_wiki
def test_shipped_items_follow_the_rule(split):
    validation, training = split
    articles = dict(validation)
    items = [json.loads(line) for line in (SHIPPED / "lambada_wiki.jsonl").read_text().splitlines()]
    assert len(items) == COUNT and len({(item["context"], item["target"]) for item in items}) == COUNT
    assert all(set(item) == {"context", "target", "source"} for item in items)
    for item in items:
        title, sentence = item["source"].rsplit(":", 1)
        text, word = articles[title], item["target"][1:]  # KeyError: not a validation article
        assert in_validation(title, 2.0) and text not in training
        assert item["target"] == " " + word and word.isalpha() and len(word) >= 3 and word.lower() not in STOP_WORDS
        start = text.index(item["context"] + item["target"])
        assert start == 0 or text[start - 2] in ".!?\"')" or text[start - 1] == "\n"  # whole sentences
        after = text[start + len(item["context"]) + len(item["target"]):]
        assert len(item["context"]) <= CONTEXT_CHARS and not re.match(r"\w", after)  # the target is a whole word
        last = sentence_starts(text)[int(sentence) - 1] - start  # where the passage's last sentence begins
        assert 0 < last < len(item["context"]), item
        assert _word(word, item["context"][:last]) and not _word(word, item["context"][last:]), item


@needs_wiki
def test_generator_reproduces_the_shipped_file(tmp_path, capsys, split):
    main(["--out", str(tmp_path / "task.jsonl")])
    assert (tmp_path / "task.jsonl").read_text() == (SHIPPED / "lambada_wiki.jsonl").read_text()
    assert f"{COUNT} items from" in capsys.readouterr().out
    validation, _ = split
    items = sample_items(validation, 40, seed=1)
    assert items == sample_items(validation, 40, seed=1) != sample_items(validation, 40, seed=2)
    titles = [item.source.rsplit(":", 1)[0] for item in items]
    assert len(set(titles)) == 40 and titles == sorted(titles, key=[title for title, _ in validation].index)  # in turn


def test_lm_eval_loads_the_task(monkeypatch):
    task, docs, rows = load_shipped_task("lambada_wiki", monkeypatch)
    assert len(docs) == COUNT and task.config.target_delimiter == "" and task.OUTPUT_TYPE == "loglikelihood"
    assert {metric["metric"] for metric in task.config.metric_list} == {"acc", "perplexity"}
    assert task.construct_requests(docs[0], task.doc_to_text(docs[0])).args == (rows[0]["context"], rows[0]["target"])
