"""Property tests of ropelab.rope: relative positions, pass-through channels, NoPE, dims, frequencies,
layouts, long-context angles and the cos/sin cache size."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ModelConfig, RopeConfig, resolve_rotary_dims
from ropelab.model import Transformer
from ropelab.rope import (
    RotaryEmbedding,
    apply_partial_rope,
    inverse_frequencies,
    rope_angles,
    rotate,
    table_cache_bytes,
)

SETTINGS = settings(max_examples=25, deadline=None)
MODEL_SETTINGS = settings(max_examples=10, deadline=None)  # these build and run a small model

layouts = st.sampled_from(["half", "interleaved"])
styles = st.sampled_from(["slice", "truncate"])
caches = st.sampled_from(["table", "none"])
head_dims = st.sampled_from([2, 4, 8, 12, 16, 32, 64])
thetas = st.sampled_from([100.0, 10_000.0, 500_000.0, 1e6])
seeds = st.integers(0, 2**31 - 1)


@st.composite
def dims(draw, min_rotary: int = 0):
    """(head_dim, rotary_dims) with rotary_dims even and <= head_dim."""
    head_dim = draw(head_dims)
    return head_dim, 2 * draw(st.integers(min_rotary // 2, head_dim // 2))


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _pair_permutation(rotary_dims: int) -> torch.Tensor:
    """Channel order taking an interleaved vector (pairs 2i, 2i+1) to half layout (pairs i, i + r/2)."""
    return torch.cat((torch.arange(0, rotary_dims, 2), torch.arange(1, rotary_dims, 2)))


# ------------------------------------------------------------- (a) relative positions


@SETTINGS
@given(dims(min_rotary=2), styles, layouts, caches, thetas, st.integers(0, 2048), st.integers(0, 2048),
       st.integers(0, 50_000), seeds)
def test_rotated_dot_product_depends_only_on_position_difference(hd_rd, style, layout, cache, theta, m, n, shift, seed):
    head_dim, rotary_dims = hd_rd
    config = RopeConfig(rotary_dims=rotary_dims, theta=theta, style=style, layout=layout, cache=cache)
    rope = RotaryEmbedding(config, head_dim)
    x = _randn(1, 1, 2, head_dim, seed=seed)  # rows: q, k

    def dots(pos_q: int, pos_k: int) -> tuple[float, float]:
        rq, rk = rope(x, x, torch.tensor([[pos_q, pos_k]]))
        q, k = rq[0, 0, 0].double(), rk[0, 0, 1].double()
        return float(q[:rotary_dims] @ k[:rotary_dims]), float(q @ k)

    scale = float(x[0, 0, 0].norm() * x[0, 0, 1].norm())
    (rot_a, full_a), (rot_b, full_b) = dots(m, n), dots(m + shift, n + shift)
    assert abs(rot_a - rot_b) <= 1e-4 * scale
    assert abs(full_a - full_b) <= 1e-4 * scale


# ------------------------------------------------------------- (b) pass-through channels


@SETTINGS
@given(dims(), styles, layouts, st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       st.integers(1, 9), seeds)
def test_unrotated_channels_are_bit_identical(hd_rd, style, layout, dtype, T, seed):
    head_dim, rotary_dims = hd_rd
    x = _randn(2, 3, T, head_dim, seed=seed, dtype=dtype)
    positions = torch.randint(0, 100_000, (2, T), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_angles(positions, inverse_frequencies(rotary_dims, head_dim, 10_000.0, style))
    out = apply_partial_rope(x, cos.unsqueeze(1), sin.unsqueeze(1), rotary_dims, layout)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out[..., rotary_dims:], x[..., rotary_dims:])
    rope = RotaryEmbedding(RopeConfig(rotary_dims=rotary_dims, style=style, layout=layout), head_dim)
    q, k = rope(x, x[:, :1], positions)
    assert torch.equal(q[..., rotary_dims:], x[..., rotary_dims:])
    assert torch.equal(k[..., rotary_dims:], x[:, :1, :, rotary_dims:])


# ------------------------------------------------------------- (c) fraction 0 is NoPE


def _tiny(rope: RopeConfig, **kw) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, d_ff=64, max_seq_len=1 << 20, rope=rope, **kw)
    return Transformer(config).eval()


@MODEL_SETTINGS
@given(st.sampled_from([{"fraction": 0.0}, {"rotary_dims": 0}, {"fraction": 0.9, "rotary_dims": 0}]),
       caches, thetas, st.integers(1, 16), st.integers(0, 100_000), seeds)
def test_fraction_zero_model_ignores_positions_and_theta(rope_kw, cache, theta, T, offset, seed):
    model = _tiny(RopeConfig(cache=cache, theta=theta, **rope_kw))
    assert all(rope.rotary_dims == 0 for rope in model.ropes)
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(seed))
    shuffled = torch.randperm(100_000, generator=torch.Generator().manual_seed(seed))[: 2 * T].view(2, T) + offset
    with torch.no_grad():
        reference = model(idx)[0]
        assert torch.equal(model(idx, position_ids=shuffled)[0], reference)
        model.set_rope_theta(theta * 7.5)
        assert torch.equal(model(idx, position_ids=shuffled)[0], reference)
        # The same weights in a RoPE model whose rotation is switched off give the same logits.
        unrotated = _tiny(RopeConfig(fraction=1.0))
        unrotated.load_state_dict(model.state_dict())
        for rope in unrotated.ropes:
            rope.forward = lambda q, k, position_ids, in_place=False: (q, k)
        assert torch.equal(unrotated(idx, position_ids=shuffled)[0], reference)
    assert model.rope_cache_bytes() == 0


# ------------------------------------------------------------- (d) rotary dims rule


@SETTINGS
@given(st.integers(2, 512), st.integers(1, 1000), st.data())
def test_resolve_rotary_dims_rule(head_dim, q, data):
    p = data.draw(st.integers(0, q))
    fraction = p / q
    exact = 2 * ((p * head_dim) // (2 * q))  # 2 * floor(fraction * head_dim / 2) in integers
    expected = 0 if p == 0 else max(2, exact)
    assert resolve_rotary_dims(head_dim, fraction) == expected
    assert RopeConfig(fraction=fraction).resolve_dims(head_dim) == expected
    explicit = 2 * data.draw(st.integers(0, head_dim // 2))
    assert resolve_rotary_dims(head_dim, fraction, explicit) == explicit
    assert RopeConfig(fraction=fraction, rotary_dims=explicit).resolve_dims(head_dim) == explicit


def test_resolve_rotary_dims_examples():
    assert resolve_rotary_dims(64, 0.25) == 16
    assert resolve_rotary_dims(64, 0.0) == 0
    assert resolve_rotary_dims(64, 0.001) == 2  # any fraction > 0 rotates at least one pair
    assert resolve_rotary_dims(20, 0.3) == 6  # decimal fractions are not lost to binary rounding
    assert resolve_rotary_dims(64, 1.0, rotary_dims=4) == 4


# ------------------------------------------------------------- (e) slice vs truncate


@SETTINGS
@given(dims(min_rotary=2), thetas)
def test_slice_and_truncate_frequencies(hd_rd, theta):
    head_dim, rotary_dims = hd_rd
    half = rotary_dims // 2
    sliced = inverse_frequencies(rotary_dims, head_dim, theta, "slice")
    truncated = inverse_frequencies(rotary_dims, head_dim, theta, "truncate")
    assert sliced.shape == truncated.shape == (half,) and sliced.dtype == torch.float64
    i = torch.arange(half, dtype=torch.float64)
    torch.testing.assert_close(sliced, theta ** (-2 * i / rotary_dims), rtol=1e-13, atol=0)
    torch.testing.assert_close(truncated, theta ** (-2 * i / head_dim), rtol=1e-13, atol=0)
    # truncate keeps the highest frequencies of the full-head spectrum; slice squeezes all of it in.
    full_head = inverse_frequencies(head_dim, head_dim, theta, "slice")
    torch.testing.assert_close(truncated, full_head[:half], rtol=1e-15, atol=0)  # pow may differ by an ulp
    assert sliced[0] == truncated[0] == 1.0
    if rotary_dims == head_dim:
        assert torch.equal(sliced, truncated)
    elif half > 1:
        assert truncated[-1] > sliced[-1]
    for style, expected in (("slice", sliced), ("truncate", truncated)):
        rope = RotaryEmbedding(RopeConfig(rotary_dims=rotary_dims, theta=theta, style=style), head_dim)
        assert torch.equal(rope.inv_freq, expected)


# ------------------------------------------------------------- (f) half vs interleaved


@SETTINGS
@given(dims(min_rotary=2), styles, st.integers(1, 8), seeds)
def test_half_and_interleaved_differ_by_a_channel_permutation(hd_rd, style, T, seed):
    head_dim, rotary_dims = hd_rd
    x = _randn(2, 3, T, head_dim, seed=seed)
    positions = torch.randint(0, 10_000, (2, T), generator=torch.Generator().manual_seed(seed))
    cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inverse_frequencies(rotary_dims, head_dim, 1e4, style)))
    perm = torch.cat((_pair_permutation(rotary_dims), torch.arange(rotary_dims, head_dim)))
    interleaved = apply_partial_rope(x, cos, sin, rotary_dims, "interleaved")
    half = apply_partial_rope(x[..., perm], cos, sin, rotary_dims, "half")
    assert torch.equal(interleaved[..., perm], half)
    assert torch.equal(rotate(x[..., :rotary_dims], cos, sin, "interleaved")[..., perm[:rotary_dims]],
                       rotate(x[..., perm[:rotary_dims]], cos, sin, "half"))


# ------------------------------------------------------------- (g) angles beyond 2^24


def _reference_cos_sin(position: int, inv_freq: torch.Tensor) -> tuple[list[float], list[float]]:
    """cos/sin of position * f with f the float64 frequency taken as exact, in 40-digit arithmetic."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):
        angles = [mpmath.mpf(position) * mpmath.mpf(float(f)) for f in inv_freq]
        return [float(mpmath.cos(a)) for a in angles], [float(mpmath.sin(a)) for a in angles]


# Up to 2^30: the float64 product position * f is then within ~1e-7 rad of the exact angle.
# (Further out float64 itself runs out: at 2^40 its rounding is ~1e-5 rad for f ~ 0.1.)
@SETTINGS
@given(st.integers(2**24, 2**30), dims(min_rotary=2), styles, thetas)
def test_long_context_angles_match_float64_reference(position, hd_rd, style, theta):
    head_dim, rotary_dims = hd_rd
    rope = RotaryEmbedding(RopeConfig(rotary_dims=rotary_dims, theta=theta, style=style, cache="none"), head_dim)
    cos, sin = rope.cos_sin(torch.tensor([[position]]))
    ref_cos, ref_sin = _reference_cos_sin(position, rope.inv_freq)
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos.flatten().double(), torch.tensor(ref_cos, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.flatten().double(), torch.tensor(ref_sin, dtype=torch.float64), rtol=0, atol=1e-6)


def test_long_context_angles_with_table_cache():
    """One table over 2^24 + 8 positions (rotary_dims 2 keeps it at ~134 MB)."""
    positions = [2**24 + 1, 2**24 + 3, 2**24 + 7]
    rope = RotaryEmbedding(RopeConfig(rotary_dims=2, theta=10_000.0, cache="table"), 64)
    cos, sin = rope.cos_sin(torch.tensor([positions]))
    assert rope.cache_bytes() == table_cache_bytes(2**24 + 8, 2)
    for j, position in enumerate(positions):
        ref_cos, ref_sin = _reference_cos_sin(position, rope.inv_freq)
        assert abs(cos[0, 0, j, 0].item() - ref_cos[0]) <= 1e-6
        assert abs(sin[0, 0, j, 0].item() - ref_sin[0]) <= 1e-6
    # float32 angles could not tell 2^24 + 1 from 2^24: the test above would catch them.
    assert torch.tensor(2**24 + 1, dtype=torch.float32).item() == 2**24
    assert abs(math.cos(2**24) - ref_cos[0]) > 1e-3 or abs(math.sin(2**24) - ref_sin[0]) > 1e-3


@pytest.mark.parametrize("positions, sliced", [
    (torch.arange(7).expand(3, 7), True),                        # running, expanded
    (torch.arange(5, 12).repeat(2, 1), True),                    # running from 5 in every row, materialised
    (torch.stack([torch.arange(7), torch.arange(2, 9)]), False),  # rows start apart
    (torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), False),              # restarting per document
    (torch.tensor([[-2, -1, 0, 1, 2, 3, 4]]), None),             # left pads below 0: angles formed, no table
])
def test_table_lookup_equals_the_angles_of_the_positions(positions, sliced):
    """Running positions shared by every row read a slice of the table (no gather); others gather;
    negative positions, which no table row holds, get their angles formed (sliced None)."""
    rope = RotaryEmbedding(RopeConfig(fraction=0.5, cache="table"), 16)
    cos, sin = rope.cos_sin(positions)
    expected_cos, expected_sin = RotaryEmbedding(RopeConfig(fraction=0.5, cache="none"), 16).cos_sin(positions)
    assert cos.shape[1:] == expected_cos.shape[1:] and cos.shape[0] == (1 if sliced else positions.shape[0])
    torch.testing.assert_close(cos.expand_as(expected_cos), expected_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.expand_as(expected_sin), expected_sin, rtol=0, atol=1e-6)
    if sliced is None:
        assert rope.cos_table is None
    else:
        assert (cos.untyped_storage().data_ptr() == rope.cos_table.untyped_storage().data_ptr()) == sliced


def test_angles_are_looked_up_once_per_position_tensor():
    """Layers sharing a RotaryEmbedding reuse the angles of the same position ids; a change to the
    ids (in place) or to theta recomputes them."""
    rope = RotaryEmbedding(RopeConfig(fraction=0.5, cache="table"), 16)
    positions = torch.arange(8).repeat(2, 1)
    first = rope.cos_sin(positions)
    assert rope.cos_sin(positions) is first
    assert rope.cos_sin(positions.clone()) is not first
    positions.add_(3)
    moved = rope.cos_sin(positions)
    torch.testing.assert_close(moved[0].expand(2, 1, 8, 4), RotaryEmbedding(RopeConfig(fraction=0.5, cache="none"), 16).cos_sin(positions)[0])
    rope.set_theta(500_000.0)
    assert not torch.equal(rope.cos_sin(positions)[0], moved[0])


# ------------------------------------------------------------- (h) cache size


@MODEL_SETTINGS
@given(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.sampled_from([None, 0.0, 0.5]), caches,
       st.integers(1, 40), st.integers(1, 40))
def test_rope_cache_bytes(fraction, layer1_fraction, cache, T, T2):
    rope_layers = {} if layer1_fraction is None else {1: {"fraction": layer1_fraction}}
    model = _tiny(RopeConfig(fraction=fraction, cache=cache), rope_layers=rope_layers)
    assert model.rope_cache_bytes() == 0
    seen = 0
    for length in (T, T2):
        seen = max(seen, length)
        with torch.no_grad():
            model(torch.zeros(1, length, dtype=torch.long))
        distinct_dims = [rope.rotary_dims for rope in model.ropes]
        expected = 0 if cache == "none" else sum(2 * seen * (rd // 2) * 4 for rd in distinct_dims)
        assert model.rope_cache_bytes() == expected
        assert expected == (0 if cache == "none" else sum(table_cache_bytes(seen, rd) for rd in distinct_dims))
    if fraction == 0.0 and layer1_fraction in (None, 0.0):
        assert model.rope_cache_bytes() == 0
