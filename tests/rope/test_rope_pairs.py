"""Selected-pair plans: the strategies, the channel permutation, the 2-norm score, and the per-KV-head
rotation (fast path against the reference, values and gradients)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ConfigError, RopeConfig
from ropelab.rope import RotaryEmbedding, apply_partial_rope, inverse_frequencies, rope_angles
from ropelab.rope.pairs import channel_order, head_rows, kept_pairs, pair_norms, pair_scores, select_pairs, top_pairs


def test_strategies_pick_the_pairs_mha2mla_names():
    assert select_pairs("high", 32, 4) == [0, 1, 2, 3]
    assert select_pairs("low", 32, 4) == [28, 29, 30, 31]
    assert select_pairs("uniform", 32, 4) == [0, 8, 16, 24]
    assert select_pairs("uniform", 32, 32) == list(range(32))
    assert select_pairs("high", 32, 0) == []
    with pytest.raises(ConfigError, match="2-norm"):
        select_pairs("2-norm", 32, 4)


def test_top_pairs_keeps_the_highest_scores_and_breaks_ties_to_the_faster_pair():
    scores = torch.tensor([[1.0, 5.0, 5.0, 0.5], [9.0, 1.0, 2.0, 3.0]])
    assert top_pairs(scores, 2) == [[1, 2], [0, 3]]
    assert top_pairs(torch.ones(1, 4), 2) == [[0, 1]]


def test_pair_scores_sum_the_query_heads_of_each_group():
    q = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])  # 4 query heads, 2 pairs
    k = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])  # 2 KV heads: groups {0, 1} and {2, 3}
    expected = torch.tensor([[(1 + 3) * 1.0, (2 + 4) * 10.0], [(5 + 7) * 100.0, (6 + 8) * 1000.0]], dtype=torch.float64)
    assert torch.equal(pair_scores(q, k), expected)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_pair_norms_match_a_loop(layout):
    x = torch.randn(2, 3, 5, 8)
    got = pair_norms(x, layout)
    for h in range(3):
        for i in range(4):
            a, b = (i, i + 4) if layout == "half" else (2 * i, 2 * i + 1)
            want = sum(float(torch.hypot(x[n, h, t, a], x[n, h, t, b])) for n in range(2) for t in range(5))
            assert got[h, i].item() == pytest.approx(want, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from(["half", "interleaved"]), st.sampled_from([4, 8, 16]))
def test_channel_order_puts_the_kept_pairs_first_in_the_layout(data, layout, head_dim):
    n = head_dim // 2
    kept = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    order = channel_order(kept, head_dim, layout)
    assert sorted(order.tolist()) == list(range(head_dim))
    r = len(kept)
    for j, i in enumerate(kept):  # new pair j holds source pair i
        new = (j, j + r) if layout == "half" else (2 * j, 2 * j + 1)
        old = (i, i + n) if layout == "half" else (2 * i, 2 * i + 1)
        assert (order[new[0]].item(), order[new[1]].item()) == old


def test_head_rows_give_each_query_head_its_group_order():
    orders = [torch.tensor([1, 0]), torch.tensor([0, 1])]
    assert head_rows(orders, 4, 2).tolist() == [1, 0, 3, 2, 4, 5, 6, 7]


def test_plan_settings_resolve_to_pairs_and_rotary_dims():
    assert kept_pairs(RopeConfig(keep_pairs=2, select="low"), 16, 2) == [[6, 7], [6, 7]]
    assert kept_pairs(RopeConfig(pairs=[[0, 5], [1, 2]]), 16, 2) == [[0, 5], [1, 2]]
    assert RopeConfig(pairs=[3, 1, 2]).resolve_dims(16) == 6
    assert kept_pairs(RopeConfig(), 16, 2) is None


@pytest.mark.parametrize("bad, match", [
    (dict(keep_pairs=9, select="high"), r"keep_pairs=9: must be an integer in 0\.\.8"),
    (dict(keep_pairs=-1, select="high"), "keep_pairs=-1"),
    (dict(keep_pairs=2), "also set model.rope.select"),
    (dict(select="low"), "also set model.rope.keep_pairs"),
    (dict(pairs=[0, 8]), "distinct integers in 0..7"),
    (dict(pairs=[1, 1]), "distinct"),
    (dict(pairs=[[0, 1], [2]]), "every KV head keeps the same number"),
    (dict(pairs=[0, 1], keep_pairs=3, select="high"), "keeps 2 per head"),
])
def test_bad_plans_are_one_line_naming_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        RopeConfig(**bad).validate(16)


def test_a_per_head_list_must_match_the_kv_heads():
    with pytest.raises(ConfigError, match="3 per-head lists but the model has 2 KV heads"):
        RopeConfig(pairs=[[0], [1], [2]]).validate_plan(16, "model.rope", 2)


def _reference(q, k, rope: RotaryEmbedding, positions):
    """Each query head rotated at its KV group's frequencies, with the reference rotation."""
    group = q.shape[1] // k.shape[1]
    inv_freq = rope.inv_freq.expand(k.shape[1], -1)  # one row per KV head, also when all heads share it
    cos, sin = rope_angles(positions, inv_freq)  # (B, T, K, r)
    cos_k, sin_k = cos.transpose(1, 2), sin.transpose(1, 2)
    cos_q, sin_q = cos_k.repeat_interleave(group, 1), sin_k.repeat_interleave(group, 1)
    r = rope.rotary_dims
    return apply_partial_rope(q, cos_q, sin_q, r, rope.layout), apply_partial_rope(k, cos_k, sin_k, r, rope.layout)


@settings(max_examples=12, deadline=None)
@given(st.data(), st.sampled_from(["half", "interleaved"]), st.sampled_from([(4, 2), (2, 2), (6, 3)]))
def test_per_head_plans_fast_path_equals_the_reference_in_values_and_gradients(data, layout, heads):
    H, K = heads
    D, n = 16, 8
    r = data.draw(st.integers(1, n))
    plan = [sorted(data.draw(st.permutations(range(n)))[:r]) for _ in range(K)]
    rope = RotaryEmbedding(RopeConfig(pairs=plan, theta=500.0, layout=layout), D, K)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 100)))
    B, T = 2, 7
    positions = torch.randint(0, 300, (B, T), generator=g)
    q0, k0 = torch.randn(B, H, T, D, generator=g), torch.randn(B, K, T, D, generator=g)
    weights = torch.randn(B, H, T, D, generator=g), torch.randn(B, K, T, D, generator=g)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qr, kr = fn(q * 1.0, k * 1.0)  # non-leaf inputs: the fast path rotates them in place
        ((qr * weights[0]).sum() + (kr * weights[1]).sum()).backward()
        return qr.detach(), kr.detach(), q.grad, k.grad

    fast = run(lambda q, k: rope(q, k, positions))
    ref = run(lambda q, k: _reference(q, k, rope, positions))
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if len({tuple(p) for p in plan}) > 1:
        assert rope.per_head and rope.cache_bytes() == 0 and rope.table_bytes(1000) == 0


def test_a_plan_shared_by_every_head_is_the_truncate_spectrum_for_high():
    plan = RotaryEmbedding(RopeConfig(keep_pairs=3, select="high", theta=1e4), 16, 2)
    assert not plan.per_head and plan.rotary_dims == 6
    assert torch.equal(plan.inv_freq, inverse_frequencies(6, 16, 1e4, "truncate"))


def test_float32_angles_follow_hf_arithmetic():
    inv = inverse_frequencies(64, 64, 1e5, "slice", "float32")
    hf = 1.0 / (1e5 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    assert torch.equal(inv.float(), hf)
    positions = torch.arange(1024)
    cos, _ = rope_angles(positions, inv, "float32")
    assert torch.equal(cos, (positions.float()[:, None] * hf[None]).cos())


def test_a_model_trains_from_scratch_with_per_head_plans_and_nope_layers(tmp_path, tiny_overrides):
    from ropelab.config import build_run_config
    from ropelab.sources import load
    from ropelab.train.loop import train

    config = build_run_config(overrides=[*tiny_overrides, "model.rope.pairs=[[0, 1], [5, 7]]",
                                         "model.rope_layers={1: {fraction: 0}}", "train.steps=4"])
    result = train(config, tmp_path / "run")
    model = load(tmp_path / "run").model
    first, second = (block.attn.rope for block in model.blocks)
    assert first.per_head and first.rotary_dims == 4 and second.rotary_dims == 0
    spectrum = inverse_frequencies(16, 16, 10_000.0)
    assert torch.equal(first.inv_freq, spectrum[torch.tensor([[0, 1], [5, 7]])])
    assert result.final_val_loss == result.final_val_loss  # finite, not NaN
