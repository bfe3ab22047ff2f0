import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.data.loader import PackedLoader, _greedy_edges, whole_windows
from ropelab.data.tokens import Shard, TokenSplit

EOS = 0


def make_split(doc_lengths, shard_docs=None):
    """Document d is (n - 1) tokens of value 1 + d % 200, then EOS; `shard_docs` documents per shard."""
    shard_docs = shard_docs or len(doc_lengths)
    shards = []
    for first in range(0, len(doc_lengths), shard_docs):
        tokens, offsets = [], [0]
        for d in range(first, min(first + shard_docs, len(doc_lengths))):
            n = doc_lengths[d]
            tokens += [1 + (d % 200)] * (n - 1) + [EOS]
            offsets.append(offsets[-1] + n)
        shards.append(Shard(np.asarray(tokens, dtype=np.uint16), np.asarray(offsets, dtype=np.int64)))
    return TokenSplit(shards)


def test_batches_are_a_function_of_seed_and_step():
    split = make_split([37, 50, 13, 90, 64] * 10)
    a, b = PackedLoader(split, 16, seed=1), PackedLoader(split, 16, seed=1)
    for step in (0, 3, 40):  # 40 crosses an epoch boundary
        assert np.array_equal(a.batch(step, 1, 4, 2).input_ids, b.batch(step, 1, 4, 2).input_ids)
    assert not np.array_equal(a.batch(0, 0, 4, 1).input_ids, PackedLoader(split, 16, seed=2).batch(0, 0, 4, 1).input_ids)


def test_ranks_and_accumulation_cover_the_same_samples():
    split = make_split([31] * 40)
    loader = PackedLoader(split, 8)
    two_ranks = [loader.batch(5, 0, 3, 1, rank=r, world=2).input_ids for r in range(2)]
    accumulated = [loader.batch(5, m, 3, 2).input_ids for m in range(2)]
    for x, y in zip(two_ranks, accumulated):
        assert np.array_equal(x, y)


def test_ranks_never_share_a_sample_within_an_epoch():
    loader = PackedLoader(make_split([9] * 50), 4)
    for step in range(3):
        rows = [tuple(row) for r in range(4) for row in loader.batch(step, 0, 3, 1, rank=r, world=4).input_ids.tolist()]
        windows = [w for r in range(4) for w in loader.sample_windows(step * 12 + r * 3, 3)]
        assert len(set(windows)) == 12 and len(rows) == 12


def test_each_epoch_visits_every_window_once():
    split = make_split([20] * 10)
    loader = PackedLoader(split, 10)
    windows = loader.sample_windows(0, loader.num_windows)
    assert sorted(windows) == list(range(loader.num_windows))


@pytest.mark.parametrize("positions", ["running", "restart"])
def test_labels_positions_and_doc_ids(positions):
    split = make_split([5, 7, 30])
    loader = PackedLoader(split, 12, positions=positions)
    x, y, pos, doc = loader.window(0)
    assert np.array_equal(y[:-1], x[1:])
    assert list(doc) == [0] * 5 + [1] * 7
    expected = list(range(12)) if positions == "running" else list(range(5)) + list(range(7))
    assert list(pos) == expected


def test_cross_windows_read_across_shards():
    split = make_split([6, 6, 6, 6], shard_docs=1)
    x, y, pos, doc = PackedLoader(split, 8, positions="restart").window(1)  # tokens 8..15
    assert list(x) == [2, 2, 2, EOS, 3, 3, 3, 3]
    assert list(y) == [2, 2, EOS, 3, 3, 3, 3, 3]
    assert list(doc) == [1, 1, 1, 1, 2, 2, 2, 2]
    assert list(pos) == [0, 1, 2, 3, 0, 1, 2, 3]  # a document begun before the window counts from its edge


def test_boundary_labels_are_masked_on_request():
    loader = PackedLoader(make_split([3, 4, 9]), 8, mask_boundary_labels=True)
    x, y, _, _ = loader.window(0)
    assert list(x) == [1, 1, EOS, 2, 2, 2, EOS, 3]
    assert list(y) == [1, EOS, -100, 2, 2, EOS, -100, 3]


def test_whole_packing_pads_and_keeps_documents_whole():
    split = make_split([3, 4, 6, 2])
    loader = PackedLoader(split, 8, pack="whole", pad_id=99, positions="restart")
    assert loader.num_windows == 2
    x, y, pos, doc = loader.window(0)
    assert list(x) == [1, 1, EOS, 2, 2, 2, EOS, 99]
    assert list(y) == [1, EOS, 2, 2, 2, EOS, 3, -100]  # the last real token predicts the next document
    assert list(doc) == [0, 0, 0, 1, 1, 1, 1, -1]
    assert list(pos[:7]) == [0, 1, 2, 0, 1, 2, 3]
    x, y, _, doc = loader.window(1)
    assert list(x) == [3] * 5 + [EOS, 4, EOS] and list(y) == [3] * 4 + [EOS, 4, EOS, -100]  # split ends


def test_whole_packing_cuts_long_documents():
    starts, lengths = whole_windows(make_split([3, 20, 2]), 8)
    assert list(zip(starts, lengths)) == [(0, 3), (3, 8), (11, 8), (19, 6)]
    assert _greedy_edges(np.array([0, 3, 3, 10]), 4).tolist() == [0, 3, 7, 10]  # an empty document in between


def _greedy_reference(split, seq_len):
    """The greedy fill window by window: end at the last document end in reach, else cut a piece."""
    starts, lengths = [], []
    for base, shard in zip(split.token_bases, split.shards):
        offsets = np.asarray(shard.doc_offsets)
        pos, end = 0, int(offsets[-1])
        while pos < end:
            boundary = int(offsets[np.searchsorted(offsets, pos + seq_len, side="right") - 1])
            stop = boundary if boundary > pos else min(pos + seq_len, end)
            starts.append(int(base) + pos)
            lengths.append(stop - pos)
            pos = stop
    return starts, lengths


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 12), st.integers(2, 24))
def test_whole_windows_tile_the_stream(lengths, shard_docs, seq_len):
    split = make_split(lengths, shard_docs)
    starts, sizes = whole_windows(split, seq_len)
    assert (starts.tolist(), sizes.tolist()) == _greedy_reference(split, seq_len)
    assert starts[0] == 0 and np.array_equal(starts[1:], (starts + sizes)[:-1]) and starts[-1] + sizes[-1] == sum(lengths)
    assert (sizes >= 1).all() and (sizes <= seq_len).all()
    boundaries = set(np.cumsum([0] + list(lengths)).tolist())
    for start, size in zip(starts, sizes):  # a window ends at a document end unless it is full
        assert size == seq_len or int(start + size) in boundaries
        if int(start) not in boundaries:  # it continues a long document cut at the previous edge
            assert int(start) - seq_len in set(starts.tolist())


def test_batch_carries_cu_seqlens():
    loader = PackedLoader(make_split([3, 4, 6, 2]), 8, pack="whole")
    batch = loader.collate([0, 1])
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 8, 14, 16]


def test_sequential_splits_windows_between_ranks():
    loader = PackedLoader(make_split(list(range(2, 40))), 8)
    rows = sorted(tuple(row) for r in range(3) for b in loader.sequential(9, 2, rank=r, world=3) for row in b.input_ids.tolist())
    assert rows == sorted(tuple(loader.window(w)[0].tolist()) for w in range(9))


def test_too_little_data_is_a_config_error():
    from ropelab.config import ConfigError

    with pytest.raises(ConfigError, match="fewer than one window"):
        PackedLoader(make_split([5]), 8, name="data/x (train)")


def test_max_doc_len_cuts_documents_into_short_ones():
    split = make_split([3, 10, 20])  # stream: doc 0 at 0..2, doc 1 at 3..12, doc 2 at 13..32
    loader = PackedLoader(split, 16, positions="restart", mask_boundary_labels=True, max_doc_len=4)
    x, y, pos, doc = loader.window(0)
    assert list(doc) == [0] * 3 + [3] * 4 + [7] * 4 + [11] * 2 + [13] * 3  # pieces named by their first position
    assert list(pos) == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    assert [i for i in range(16) if y[i] == -100] == [2, 6, 10, 12]  # no loss across any piece boundary
    running = PackedLoader(split, 16, max_doc_len=4).window(0)
    assert list(running[2]) == list(range(16)) and list(running[3]) == list(doc)


def distinct_split(n: int) -> TokenSplit:
    """One document whose tokens are 1, 2, ..., n - 1 and EOS: every token tells where it came from."""
    return TokenSplit([Shard(np.asarray(list(range(1, n)) + [EOS], dtype=np.uint16), np.asarray([0, n], dtype=np.int64))])


@settings(max_examples=40, deadline=None)
@given(span=st.integers(1, 7), seed=st.integers(0, 10_000), window=st.integers(0, 9))
def test_copy_span_repeats_one_earlier_span_later_and_labels_follow(span, seed, window):
    split = distinct_split(16 * 10 + 1)
    plain = PackedLoader(split, 16, seed=seed).window(window)
    x, y, pos, doc = PackedLoader(split, 16, seed=seed, copy_span=span, copy_share=1.0).window(window)
    stream = np.append(x, y[-1])  # the window's 17 tokens after the copy
    original = np.append(plain[0], plain[1][-1])
    changed = np.flatnonzero(stream != original)
    assert len(changed) <= span and np.array_equal(y[:-1], x[1:])  # labels read the changed tokens
    # exactly one later place holds a span of the original found earlier
    matches = [(s, t) for s in range(17 - span) for t in range(s + span, 18 - span)
               if np.array_equal(stream[t : t + span], original[s : s + span]) and np.array_equal(stream[: t], original[: t])
               and np.array_equal(stream[t + span :], original[t + span :])]
    assert matches
    assert np.array_equal(pos, plain[2]) and np.array_equal(doc, plain[3])


def test_copy_share_picks_windows_by_seed_and_window_only():
    split = distinct_split(16 * 200 + 1)
    loader = PackedLoader(split, 16, seed=3, copy_span=4, copy_share=0.25)
    plain = PackedLoader(split, 16, seed=3)
    copied = [w for w in range(200) if not np.array_equal(loader.window(w)[0], plain.window(w)[0])
              or not np.array_equal(loader.window(w)[1], plain.window(w)[1])]
    assert 25 <= len(copied) <= 75  # about a quarter of 200 windows
    again = PackedLoader(split, 16, seed=3, copy_span=4, copy_share=0.25)
    assert all(np.array_equal(again.window(w)[0], loader.window(w)[0]) for w in range(200))


@pytest.mark.parametrize("overrides, message", [
    (["data.copy_span=8", "data.pack=whole"], r"^data.copy_span: needs data.pack=cross and no data.max_doc_len"),
    (["data.copy_span=8", "data.max_doc_len=16"], r"^data.copy_span: needs data.pack=cross"),
    (["data.copy_span=128", "data.seq_len=256"], r"^data.copy_span=128: .* below data.seq_len / 2 = 128"),
    (["data.copy_span=0"], r"^data.copy_span"),
    (["data.copy_share=0"], r"^data.copy_share=0(\.0)?: must be in \(0, 1\]"),
    (["data.copy_share=1.5"], r"^data.copy_share=1.5"),
])
def test_copy_span_settings_are_checked(overrides, message):
    from ropelab.config import ConfigError, build_run_config

    with pytest.raises(ConfigError, match=message):
        build_run_config(overrides=overrides)


def test_copy_span_reaches_the_training_loader_only():
    from ropelab.config import build_run_config
    from ropelab.data.pipeline import build_loaders

    config = build_run_config(overrides=["data.copy_span=8", "data.copy_share=0.75", "data.seq_len=32"])
    train, validation, _ = build_loaders(config)
    assert (train.copy_span, train.copy_share) == (8, 0.75) and validation.copy_span is None


def test_interleaved_loaders_each_keep_their_epoch_order():
    """A stack's members draw batches from their own loaders in turn (`ropelab.train.stacked_loop`): each
    loader keeps its epoch's window order instead of drawing it again on every call."""
    split = make_split([500, 300, 700])
    loaders = [PackedLoader(split, seq_len=16, seed=seed) for seed in range(3)]
    for loader in loaders:
        loader.batch(0, 0, 2, 1)
    orders = [loader.epoch_order[1] for loader in loaders]
    for step in range(1, 4):
        for loader, order in zip(loaders, orders):
            alone = PackedLoader(split, seq_len=16, seed=loader.seed).batch(step, 0, 2, 1)
            assert np.array_equal(loader.batch(step, 0, 2, 1).input_ids, alone.input_ids)
            assert loader.epoch_order[1] is order
