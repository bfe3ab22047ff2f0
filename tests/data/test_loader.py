import numpy as np
import pytest

from ropelab.data.loader import PackedLoader
from ropelab.data.tokens import TokenSplit


def make_split(doc_lengths, eos=0):
    tokens, offsets = [], [0]
    for d, n in enumerate(doc_lengths):
        tokens += [1 + (d % 200)] * (n - 1) + [eos]
        offsets.append(offsets[-1] + n)
    return TokenSplit(np.asarray(tokens, dtype=np.uint16), np.asarray(offsets, dtype=np.int64))


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
