"""The 2-norm calibration against a hand computation, and the check right after conversion."""

import pytest
import torch

from ropelab.data.loader import Batch
from ropelab.sources.calibrate import held_out_check, pair_norm_means, two_norm_scores

from tests.sources.test_plans import KV, N_PAIRS, source_model


def batch(tokens: torch.Tensor) -> Batch:
    B, T = tokens.shape
    ids = torch.zeros(B, T, dtype=torch.long)
    return Batch(tokens, tokens.roll(-1, 1), torch.arange(T).expand(B, T), ids, None)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_two_norm_scores_equal_a_hand_computation(layout):
    model = source_model(layout)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    captured = {}
    model.blocks[1].attn_norm.register_forward_hook(lambda m, i, out: captured.setdefault("x", out.detach()))
    scores = two_norm_scores(model, [batch(tokens)])
    attn = model.blocks[1].attn
    x = captured["x"]  # (B, T, C): what layer 1's projections read
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).detach().view(2, 9, 4, 16)
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).detach().view(2, 9, KV, 16)

    def mean_norm(t, head, pair):
        a, b = (pair, pair + 8) if layout == "half" else (2 * pair, 2 * pair + 1)
        return sum(float(torch.hypot(t[n, s, head, a], t[n, s, head, b])) for n in range(2) for s in range(9)) / 18

    for group in range(KV):
        for pair in range(N_PAIRS):
            want = sum(mean_norm(q, h, pair) for h in (2 * group, 2 * group + 1)) * mean_norm(k, group, pair)
            assert scores[1][group, pair].item() == pytest.approx(want, rel=1e-5)


def test_norm_means_average_over_every_token_of_every_batch():
    model = source_model()
    tokens = torch.randint(0, 97, (4, 6))
    whole = pair_norm_means(model, [batch(tokens)])
    halves = pair_norm_means(model, [batch(tokens[:2]), batch(tokens[2:])])
    for (q1, k1), (q2, k2) in zip(whole, halves):
        torch.testing.assert_close(q1, q2)
        torch.testing.assert_close(k1, k2)


def test_the_check_after_conversion_is_zero_kl_for_the_same_model():
    model = source_model()
    tokens = torch.randint(0, 97, (2, 12))
    check = held_out_check(model, model, [batch(tokens)])
    assert check["kl_to_source"] == pytest.approx(0.0, abs=1e-6)
    assert check["loss_source"] == check["loss_converted"] and check["tokens"] == 24
    other = held_out_check(model, source_model(seed=1), [batch(tokens)])
    assert other["kl_to_source"] > 0.1
