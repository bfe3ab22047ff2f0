"""The multiple-choice task `nextline_stdlib`: the rule on small synthetic files, the shipped items in
the schema and true to their source, lm-eval's loader on the YAML, and the task run through
`evaluate_lm` on a tiny trained run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ropelab.data.corpus import stdlib_root, stdlib_text
from ropelab.evaluate.nextline_stdlib import CHOICES, CONTEXT_CHARS, COUNT, Item, Passage, file_passages, main, sample_items
from ropelab.evaluate.task_generators import corpus_split
from tests.evaluate.local_tasks import load_shipped_task

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "configs" / "eval"

SOURCE = '''import os

def area(width, height):
    x = 1

    return width * height
'''


def test_rule_on_a_small_file():
    assert file_passages("m.py", SOURCE) == [
        # "import os" has no two non-blank lines before it, "x = 1" is too short
        Passage("import os\n\ndef area(width, height):\n    x = 1\n\n", "    return width * height", "m.py:6"),
    ]
    assert file_passages("m.py", SOURCE, context_chars=20) == []  # "def area(...)" and "x = 1" do not fit in 20
    assert file_passages("m.py", SOURCE.replace("height):", "height):  ")) == [
        Passage("import os\n\ndef area(width, height):  \n    x = 1\n\n", "    return width * height", "m.py:6"),
    ]  # passages are whole lines, verbatim; the true line is what is stripped


def _file(width: int) -> str:
    """A file whose every line from the third on is a true line, the n-th of about n + width characters."""
    return "".join(f"    value_{width}_{n} = {'x' * n}\n" for n in range(12))


DOCUMENTS = [(f"f{width}.py", _file(width)) for width in (10, 20, 30, 40)]


def test_items_follow_the_rule():
    seen = {"value_10_5 = xxxxx", "value_20_7 = xxxxxxx"}  # "training" lines, indentation left off
    items = sample_items(DOCUMENTS, seen, count=20, seed=3)
    lines = {passage.line: passage.source.split(":")[0] for key, text in DOCUMENTS for passage in file_passages(key, text)}
    truths = [item.choices[item.label] for item in items]
    assert len(items) == 20 and [item.source.split(":")[0] for item in items].count("f10.py") == 5  # in turn
    for item, truth in zip(items, truths):
        assert len(item.choices) == CHOICES and len({choice.strip() for choice in item.choices}) == CHOICES
        assert truth.strip() not in seen and item.context.endswith("\n")
        path, line = item.source.split(":")
        text = dict(DOCUMENTS)[path].splitlines()
        head = "".join(kept + "\n" for kept in text[:int(line) - 1])
        assert text[int(line) - 1] == truth and head.endswith(item.context) and len(item.context) <= CONTEXT_CHARS
        before = head[:-len(item.context)]  # the passage is the longest run of whole lines that fits
        assert not before or len(before[:-1].rsplit("\n", 1)[-1]) + 1 + len(item.context) > CONTEXT_CHARS
        distractors = [choice for choice in item.choices if choice != truth]
        assert all(lines[d] != path and d in truths for d in distractors)  # true lines of other items, other files
        others = sorted(abs(len(t) - len(truth)) for t in truths if lines[t] != path)
        assert sorted(abs(len(d) - len(truth)) for d in distractors) == others[:CHOICES - 1]  # the closest lengths
    assert sample_items(DOCUMENTS, seen, count=20, seed=3) == items
    again = sample_items(DOCUMENTS, seen, count=20, seed=4)
    assert [item.label for item in again] != [item.label for item in items]
    with pytest.raises(ValueError, match="fewer than 3 distinct lines"):
        sample_items(DOCUMENTS[:1], seen, count=5)


def test_shipped_items_are_in_the_schema_and_true_to_the_stdlib():
    rows = [json.loads(line) for line in (TASKS / "nextline_stdlib.jsonl").read_text().splitlines()]
    assert len(rows) == COUNT and all(set(row) == {"context", "choices", "label", "source"} for row in rows)
    assert len({row["source"] for row in rows}) == COUNT and len({row["source"].split(":")[0] for row in rows}) >= 10
    for row in rows:
        item = Item(**row)
        assert len(item.choices) == CHOICES and 0 <= item.label < CHOICES and len(set(item.choices)) == CHOICES
        assert item.context.endswith("\n") and len(item.context) <= CONTEXT_CHARS
    files = {row["choices"][row["label"]]: row["source"].split(":")[0] for row in rows}  # true line -> its file
    for row in rows:  # distractors: true lines of other files' items
        assert all(files[choice] != row["source"].split(":")[0] for choice in row["choices"] if choice != row["choices"][row["label"]])
    if sys.version_info[:2] == (3, 11):  # the Python whose stdlib the shipped items come from
        documents, training = corpus_split("stdlib")
        seen = {line.strip() for text in training for line in text.split("\n")}
        for row in rows:
            path, line = row["source"].rsplit(":", 1)
            text = stdlib_text(stdlib_root() / path).split("\n")
            truth, head = row["choices"][row["label"]], "".join(kept + "\n" for kept in text[:int(line) - 1])
            assert text[int(line) - 1].rstrip() == truth and head.endswith(row["context"])
            assert truth.strip() not in seen
        assert sample_items(documents, seen) == [Item(**row) for row in rows]


def test_generator_writes_the_items(tmp_path, capsys):
    main(["--out", str(tmp_path / "task.jsonl"), "--count", "40", "--seed", "1"])
    written = [Item(**json.loads(line)) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    assert len(written) == 40 and "40 items from" in capsys.readouterr().out
    documents, training = corpus_split("stdlib")
    assert written == sample_items(documents, {line.strip() for text in training for line in text.split("\n")}, 40, seed=1)


def test_lm_eval_loads_the_task(monkeypatch):
    task, docs, rows = load_shipped_task("nextline_stdlib", monkeypatch)
    assert len(docs) == COUNT and task.config.target_delimiter == "" and task.OUTPUT_TYPE == "multiple_choice"
    first = rows[0]
    assert task.doc_to_text(docs[0]) == first["context"] and task.doc_to_choice(docs[0]) == first["choices"]
    assert task.doc_to_target(docs[0]) == first["label"]
    requests = task.construct_requests(docs[0], task.doc_to_text(docs[0]))
    assert [request.args for request in requests] == [(first["context"], choice) for choice in first["choices"]]


def test_eval_lm_scores_the_task_on_a_tiny_run(run, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from ropelab.evaluate.lm_eval import evaluate_lm

    monkeypatch.chdir(ROOT)
    results = evaluate_lm([run], ["nextline_stdlib"], tmp_path / "eval", limit=20, include_path=TASKS, max_length=128,
                          bootstrap_iters=0)  # a line may be more than the run's 32 tokens
    metrics = results["runs"][0]["metrics"]["nextline_stdlib"]
    assert set(metrics) == {"acc_norm"}  # evaluate_lm reports acc_norm where the harness has it, as the seed does
    assert 0 <= metrics["acc_norm"][0] <= 1
    assert results["runs"][0]["n_samples"]["nextline_stdlib"] == {"original": COUNT, "effective": 20}
