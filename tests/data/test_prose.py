"""The built-in corpus `stdlib-prose`: what is extracted from a file, and the corpus through the token
pipeline with every kind of tokenizer, on a small stand-in for the standard library (the same files,
keys and split as `stdlib`, a cache folder of its own)."""

from __future__ import annotations

import numpy as np
import pytest

from ropelab.config import build_run_config
from ropelab.data import corpus, sources
from ropelab.data.corpus import stdlib_files, stdlib_text
from ropelab.data.pipeline import build_loaders, token_folder
from ropelab.data.prose import MIN_PROSE_CHARS, source_prose, stdlib_prose
from ropelab.data.sources import Source, corpus_documents, corpus_key
from ropelab.data.tokenizer import load_tokenizer
from ropelab.data.tokens import open_split

LONG = "This paragraph explains, in plain English, what the function below is for. " * 3

SOURCE = f'''#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""Module docstring: {LONG}"""

# ----------------------------------------------
# A block comment that runs
# over two lines; a coding: here is prose.
import os  # an inline comment, annotating code

class Thing:
    """Class docstring."""
    label = "a string that is no docstring"

    async def run(self):  # noqa: E501
        """Coroutine docstring."""
        # type: ignore
        return os.sep


def helper():
    """Function docstring,
       indented."""
'''


def test_docstrings_and_whole_line_comments_in_source_order():
    assert source_prose(SOURCE).split("\n\n") == [
        f"Module docstring: {LONG.strip()}", "A block comment that runs\nover two lines; a coding: here is prose.", "Class docstring.",
        "Coroutine docstring.", "Function docstring,\nindented.",
    ]


def test_too_little_prose_or_no_parse_gives_no_document():
    short = '"""' + "x" * (MIN_PROSE_CHARS - 1) + '"""\n'
    assert source_prose(short) == "" and source_prose(short.replace("x", "y", 1) + "# z\n") != ""
    assert source_prose(SOURCE + "def broken(:\n") == ""


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """Ten small modules as the standard library: m3, m4 and m6 are held out at val_percent=30; m6 and m9
    have too little prose for `stdlib-prose`."""
    root = tmp_path / "stdlib"
    root.mkdir()
    for i in range(10):
        prose = "" if i in (6, 9) else f'"""Module {i}. {LONG}"""\n# Comment of module {i}.\n'
        (root / f"m{i}.py").write_text(f"{prose}def f{i}(x):\n    return x * {i}  # times {i}\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    monkeypatch.setattr(sources, "stdlib_root", lambda: root)
    return root


def _texts(folder, split, tokenizer):
    tokens = open_split(folder, split)
    docs = []
    for shard in tokens.shards:
        for a, b in zip(shard.doc_offsets[:-1], shard.doc_offsets[1:]):
            ids = np.asarray(shard.tokens[a:b])
            assert ids[-1] == tokenizer.eos_id
            docs.append(tokenizer.decode(ids[:-1].tolist()))
    return docs


def test_corpus_through_the_pipeline_with_each_tokenizer(fake_stdlib, tmp_path):
    val_percent = 30
    expected = {split: [stdlib_prose(p) for p in stdlib_files(split, val_percent) if stdlib_prose(p)] for split in ("train", "validation")}
    assert [p.name for p in stdlib_files("validation", val_percent)] == ["m3.py", "m4.py", "m6.py"]
    assert list(corpus_documents("stdlib-prose", "validation", val_percent)) == expected["validation"] == [
        source_prose(text) for text in corpus_documents("stdlib", "validation", val_percent) if source_prose(text)]
    assert corpus_key("stdlib-prose", val_percent) != corpus_key("stdlib", val_percent)
    assert Source("stdlib-prose").describe() == {"kind": "stdlib-prose", "name": "stdlib-prose", "python": Source("stdlib").describe()["python"], "extraction": "1"}

    bpe = load_tokenizer("bpe:300", "stdlib", val_percent)  # trained on the (stand-in) stdlib, as for `stdlib`
    bpe.save(tmp_path / "tokenizer.json")
    for spec in ("bytes", "bpe:300", str(tmp_path / "tokenizer.json")):
        config = build_run_config(overrides=["data.corpus=stdlib-prose", f"data.tokenizer={spec}", f"data.val_percent={val_percent}", "data.seq_len=16"])
        folder = token_folder(config)
        code = token_folder(build_run_config(overrides=["data.corpus=stdlib", f"data.tokenizer={spec}", f"data.val_percent={val_percent}"]))
        assert folder.name.startswith("stdlib-prose-") and folder != code
        tokenizer = load_tokenizer(spec, "stdlib-prose", val_percent)
        for split, texts in expected.items():
            assert _texts(folder, split, tokenizer) == texts, (spec, split)
        assert _texts(code, "validation", tokenizer) == [stdlib_text(p) for p in stdlib_files("validation", val_percent)]
    train, val, manifest = build_loaders(config)
    assert manifest["empty_documents"] == 2 and manifest["source"]["kind"] == "stdlib-prose" and val.num_windows > 0


def test_real_stdlib_validation_split_is_english_prose():
    docs = list(corpus_documents("stdlib-prose", "validation"))
    assert 5 <= len(docs) <= len(stdlib_files("validation"))
    for text in docs:
        assert len(text) >= MIN_PROSE_CHARS and sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
