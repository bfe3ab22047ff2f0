"""The LAMBADA-like task `lambada_stdlib`: the rule on a small file, the shipped items checked against
the rule by an independent reading of it, the generator deterministic for a seed, and the task run
through `evaluate_lm` on a tiny trained run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ropelab.data.corpus import in_validation, stdlib_entries, stdlib_text
from ropelab.evaluate.lambada_stdlib import CONTEXT_CHARS, COUNT, file_items, is_target_name, main, sample_items
from ropelab.evaluate.task_generators import LastWordItem

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "configs" / "eval"

SOURCE = '''def area(width, height):
    """Area of a rectangle."""
    product = width * height
    size = len(self.sizes) + product + product
    return product, ab
'''


def test_rule_on_a_small_file():
    head = SOURCE.split("\n    product")[0] + "\n"
    assert file_items("m.py", SOURCE) == [
        LastWordItem(head + "    product =", " width", "m.py:3"),
        LastWordItem(head + "    product = width *", " height", "m.py:3"),
        LastWordItem(head + "    product = width * height\n    size = len(self.sizes) +", " product", "m.py:4"),
        # the second product of line 4 is in its own line already; len and self are builtin; ab is too short
        LastWordItem(SOURCE.rsplit(" product,", 1)[0], " product", "m.py:5"),
    ]
    assert file_items("m.py", SOURCE, context_chars=20) == []  # no earlier line fits in 20 characters
    assert file_items("m.py", SOURCE + "def broken(:\n    '''") == []


def _word(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None


def test_shipped_items_follow_the_rule():
    items = [json.loads(line) for line in (TASKS / "lambada_stdlib.jsonl").read_text().splitlines()]
    assert len(items) == COUNT and len({(i["context"], i["target"]) for i in items}) == COUNT
    seen = "\n".join(stdlib_text(path) for key, path in stdlib_entries() if not in_validation(key, 2.0))
    for item in items:
        context, target, word = item["context"], item["target"], item["target"].lstrip(" \t")
        *earlier, last = context.split("\n")
        assert in_validation(item["source"].rsplit(":", 1)[0], 2.0)
        assert word.isidentifier() and is_target_name(word) and len(context) + len(target) - len(word) <= CONTEXT_CHARS
        assert earlier and last.strip() and not context.endswith((" ", "\t"))
        assert _word(word, "\n".join(earlier)) and not _word(word, last), item
        if sys.version_info[:2] == (3, 11):  # the Python whose stdlib the shipped items come from
            assert (last + target).lstrip() not in seen, item


def test_generator_is_deterministic_for_a_seed(tmp_path):
    main(["--out", str(tmp_path / "task.jsonl"), "--count", "40"])
    written = [LastWordItem(**json.loads(line)) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    entries = [(key, stdlib_text(path)) for key, path in stdlib_entries() if in_validation(key, 2.0)]
    seen = "\n".join(stdlib_text(path) for key, path in stdlib_entries() if not in_validation(key, 2.0))
    assert sample_items(entries, seen, 40, seed=0) == written and len(written) == 40
    small = [(key, text) for key, text in entries if len(text) < 20_000]
    assert sample_items(small, seen, 10, seed=1) != sample_items(small, seen, 10, seed=0)
    files = [item.source.split(":")[0] for item in written]
    assert files == sorted(files, key=[key for key, _ in entries].index) and len(set(files)) >= 10  # in turn, in file order


def test_eval_lm_scores_the_task_on_a_tiny_run(run, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from ropelab.evaluate.lm_eval import evaluate_lm

    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the checkout
    results = evaluate_lm([run], ["lambada_stdlib"], tmp_path / "eval", limit=40, include_path=TASKS, bootstrap_iters=0)
    metrics = results["runs"][0]["metrics"]["lambada_stdlib"]
    assert set(metrics) == {"acc", "perplexity"} and results["runs"][0]["n_samples"]["lambada_stdlib"] == {"original": COUNT, "effective": 40}
    assert 0 <= metrics["acc"][0] <= 1 and metrics["perplexity"][0] > 1
    assert (tmp_path / "eval" / "lambada_ppl_vs_fraction.png").is_file()
