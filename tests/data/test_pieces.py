"""Short documents only, provably: `data.piece_order=apart` lays the pieces of a document a window apart,
so that no training window holds more than `data.max_doc_len` tokens of any source document. The
end-to-end test reads every training window of a prepared corpus whose documents are each one letter
repeated, so that a window's letters count its tokens of each source document without the loader's help."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ConfigError, build_run_config
from ropelab.data.pieces import apart_order
from ropelab.data.pipeline import build_loaders
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import ByteTokenizer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.integers(1, 40), st.integers(1, 120))
def test_pieces_are_short_and_a_gap_apart(lengths, piece_len, gap):
    ends = np.cumsum(lengths).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    starts, sizes = apart_order(spans, piece_len, gap)
    assert np.all(sizes <= piece_len) and np.all(sizes > 0)
    owner = np.searchsorted(ends, starts, side="right")
    new_start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for doc, (a, b) in enumerate(spans):
        mine = np.flatnonzero(owner == doc)
        # a document's pieces in its own order, from its start, without holes; only its tail may be dropped
        assert list(starts[mine]) == list(range(a, a + piece_len * len(mine), piece_len))[: len(mine)]
        gaps = new_start[mine[1:]] - (new_start[mine[:-1]] + sizes[mine[:-1]])
        assert np.all(gaps >= gap)
    assert sizes.sum() > 0


def test_every_document_in_full_when_there_are_enough_documents():
    spans = [(i * 100, i * 100 + 100) for i in range(20)]
    starts, sizes = apart_order(spans, 10, gap=30)
    assert sizes.sum() == 2000 and sorted(starts.tolist()) == list(range(0, 2000, 10))


SHORT, WINDOW = 16, 64


@pytest.fixture(scope="module")
def letters_folder(tmp_path_factory):
    """26 documents of 150 to 400 tokens; document k is one letter repeated."""
    folder = tmp_path_factory.mktemp("letters")
    rows = [{"text": letter * (150 + 10 * k)} for k, letter in enumerate(string.ascii_lowercase)]
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    prepare(Source(str(folder / "docs.jsonl")), ByteTokenizer(), folder / "tokens", val_percent=20, progress=False)
    return folder / "tokens"


def most_of_one_document(loader) -> int:
    """The most tokens of one source document in any training window the loader yields."""
    most = 0
    for w in range(loader.num_windows):
        x, _, _, _ = loader.window(w)
        letters = x[(x >= ord("a")) & (x <= ord("z"))]
        most = max(most, int(np.bincount(letters).max(initial=0)))
    return most


def config(folder, order):
    return build_run_config(overrides=[f"data.corpus={folder}", f"data.seq_len={WINDOW}", f"data.max_doc_len={SHORT}",
                                       f"data.piece_order={order}", "attention.doc_mask=true", "data.mask_boundary_labels=true"])


def test_no_training_window_holds_more_than_the_short_window_of_a_document(letters_folder):
    train, _, manifest = build_loaders(config(letters_folder, "apart"))
    assert train.num_windows > 10 and manifest["apart_pieces"]["dropped_tokens"] < 0.2 * manifest["apart_pieces"]["tokens"]
    assert most_of_one_document(train) <= SHORT
    x, y, pos, doc = train.window(3)
    assert list(pos) == list(range(WINDOW))  # positions run across the window
    for piece in np.unique(doc):  # each piece is a document of at most the short window, no loss across its end
        where = np.flatnonzero(doc == piece)
        assert len(where) <= SHORT and np.all(np.diff(where) == 1) and len(set(x[where].tolist()) - {256}) <= 1
    ends = np.flatnonzero(doc[:-1] != doc[1:])
    assert np.all(y[ends] == -100)


def test_in_stream_order_a_window_holds_a_long_run_of_one_document(letters_folder):
    train, _, _ = build_loaders(config(letters_folder, "stream"))
    assert most_of_one_document(train) > SHORT  # what `apart` prevents: the check above can fail


def test_apart_needs_the_pieces_length_and_cross_packing():
    with pytest.raises(ConfigError, match=r"^data.piece_order=apart: needs data.max_doc_len"):
        build_run_config(overrides=["data.piece_order=apart"])
    with pytest.raises(ConfigError, match=r"^data.piece_order=apart"):
        build_run_config(overrides=["data.piece_order=apart", "data.max_doc_len=16", "data.pack=whole"])
