import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ropelab.probe import metrics


def test_distances_to_first_hand_computed():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [-1.0, 0.0]])
    assert metrics.cosine_distance_to_first(x).tolist() == pytest.approx([0.0, 1.0, 0.0, 2.0])
    assert metrics.relative_l2_to_first(x).tolist() == pytest.approx([0.0, math.sqrt(2), 1.0, 2.0])


def test_distances_flatten_heads_and_channels():
    x = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]])  # (R=2, H=2, D=2)
    assert metrics.cosine_distance_to_first(x).tolist() == pytest.approx([0.0, 1 - 1 / math.sqrt(2)])
    assert metrics.relative_l2_to_first(x).tolist() == pytest.approx([0.0, 1.0])


def test_zero_first_repeat():
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    assert metrics.cosine_distance_to_first(x).tolist() == [1.0, 1.0]
    assert all(math.isnan(v) for v in metrics.relative_l2_to_first(x).tolist())


def test_channel_variance_is_population_variance_over_repeats():
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert metrics.channel_variance(x).tolist() == pytest.approx([1.0, 4.0])


def test_split_variance_rotated_unrotated():
    variance = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0]])  # (heads, channels)
    rotated = torch.tensor([True, True, False, False])
    assert metrics.split_variance(variance, rotated) == pytest.approx({"rotated": 2.5, "unrotated": 4.5})
    nope = metrics.split_variance(variance, torch.zeros(4, dtype=torch.bool))
    assert nope["rotated"] is None and nope["unrotated"] == pytest.approx(3.5)


def test_kl_to_first_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0]], dtype=torch.float64)  # p = (.5, .5), (.75, .25), (.5, .5)
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert metrics.kl_to_first(logits).tolist() == pytest.approx([0.0, expected, 0.0], abs=1e-12)


def test_deviation_from_first_hand_computed():
    x = torch.tensor([[1.0, -1.0], [2.0, -1.0], [1.0, 1.0]])  # rms of the first repeat: 1
    assert metrics.deviation_from_first(x).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]
    heads = torch.tensor([[[2.0, 0.0], [0.0, 2.0]], [[4.0, 0.0], [0.0, 2.0]]])  # (R, H, D); rms(x_0) = sqrt(2)
    assert metrics.deviation_from_first(heads).flatten().tolist() == pytest.approx([0.0, 1 / math.sqrt(2), 0.0, 0.0])


vectors = st.lists(st.floats(-10, 10, allow_nan=False), min_size=6, max_size=6).filter(lambda v: sum(a * a for a in v) > 1e-3)


@settings(max_examples=50, deadline=None)
@given(vectors, vectors, st.floats(0.1, 10))
def test_distance_invariants(first, other, scale):
    x = torch.tensor([first, other], dtype=torch.float64)
    scaled = x.clone()
    scaled[1] *= scale
    cos = metrics.cosine_distance_to_first(x)
    assert cos[0] == pytest.approx(0.0, abs=1e-12) and 0.0 <= float(cos[1]) <= 2.0 + 1e-12
    assert metrics.cosine_distance_to_first(scaled)[1] == pytest.approx(float(cos[1]), abs=1e-9)
    assert metrics.relative_l2_to_first(x * scale).tolist() == pytest.approx(metrics.relative_l2_to_first(x).tolist())


@settings(max_examples=50, deadline=None)
@given(vectors, vectors, st.floats(-5, 5))
def test_kl_invariants(first, other, shift):
    logits = torch.tensor([first, other, first], dtype=torch.float64)
    kl = metrics.kl_to_first(logits)
    assert float(kl[1]) >= 0.0 and float(kl[0]) == 0.0 and float(kl[2]) == pytest.approx(0.0, abs=1e-12)
    assert metrics.kl_to_first(logits + shift)[1] == pytest.approx(float(kl[1]), abs=1e-9)
