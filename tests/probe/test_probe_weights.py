import math

import pytest
import torch

from ropelab.config import ConfigError
from ropelab.model import Transformer
from ropelab.probe.channels import LayerRope, channel_pairs, layer_rope
from ropelab.probe.weights import projection_changes, weight_changes

from probe_helpers import tiny_config, tiny_model


def test_channel_pairs_follow_the_layout():
    assert channel_pairs(8, 4, "half").tolist() == [0, 1, 0, 1, -1, -1, -1, -1]
    assert channel_pairs(8, 4, "interleaved").tolist() == [0, 0, 1, 1, -1, -1, -1, -1]
    assert channel_pairs(4, 0, "half").tolist() == [-1] * 4


def test_layer_rope_frequencies():
    rope = layer_rope(tiny_config("model.rope.theta=100").model, 0)  # head_dim 16, 8 rotated, slice style
    assert rope.rotary_dims == 8 and rope.inv_freq == pytest.approx([100 ** (-i / 8) for i in (0, 2, 4, 6)])
    assert rope.wavelengths[0] == pytest.approx(2 * math.pi)


@pytest.mark.parametrize("layout, pair", [("half", 0), ("interleaved", 1)])
def test_projection_changes_hand_computed(layout, pair):
    # 2 heads x 6 channels, 4 rotated; all-ones W_A (12 x 3). Row 8 = head 1, channel 2: pair 0 under
    # half (2 pairs with 0), pair 1 under interleaved (2 pairs with 3). Row 5 = head 0, channel 5: unrotated.
    rope = LayerRope(head_dim=6, rotary_dims=4, layout=layout, theta=10_000.0, inv_freq=(1.0, 0.01))
    w_a = torch.ones(12, 3)
    w_b = w_a.clone()
    w_b[8] += 2.0  # ||delta||^2 = 12 on a pair whose two rows have ||W_A||^2 = 6
    w_b[5] += 1.0  # ||delta||^2 = 3 on head 0's two unrotated rows, ||W_A||^2 = 6
    out = projection_changes(w_a, w_b, heads=2, rope=rope)
    expected = [0.0] * 4  # (head, pair) row-major
    expected[2 + pair] = math.sqrt(12 / 6)
    assert [v for head in out["per_head_pair"] for v in head] == pytest.approx(expected)
    assert out["per_head_unrotated"] == pytest.approx([math.sqrt(3 / 6), 0.0])
    assert out["unrotated"] == pytest.approx(math.sqrt(3 / 12))
    assert out["per_head"] == pytest.approx([math.sqrt(3 / 18), math.sqrt(12 / 18)])
    assert out["per_pair"][pair] == pytest.approx(math.sqrt(12 / 12)) and out["per_pair"][1 - pair] == 0.0
    assert out["relative_change"] == pytest.approx(math.sqrt(15 / 36))


def test_weight_changes_rank_the_changed_span_first():
    a = tiny_model(0, "model.rope.layout=interleaved")
    b = Transformer(a.config)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # layer 1, W_k, head 0, channels 2 and 3: interleaved pair 1
        b.blocks[1].attn.k_proj.weight[2:4] *= 3.0
        b.blocks[0].attn.q_proj.weight[20] *= 1.1  # head 1, channel 4: pair 2, a smaller change
    changes = weight_changes(a, b, top=3)
    first, second = changes["top_spans"][:2]
    assert (first["layer"], first["proj"], first["head"], first["pair"], first["rows"]) == (1, "k", 0, 1, [2, 3])
    assert first["relative_change"] == pytest.approx(2.0)
    assert (second["layer"], second["proj"], second["head"], second["pair"]) == (0, "q", 1, 2)
    assert second["relative_change"] < first["relative_change"] and changes["top_spans"][2]["relative_change"] == 0.0
    assert len(changes["heatmap"]["q"]) == 2 and len(changes["heatmap"]["q"][0]) == 4 + 1  # 4 pairs + unrotated


def test_weight_changes_refuse_mismatched_rotation():
    with pytest.raises(ConfigError, match="rotates 8 channels"):
        weight_changes(tiny_model(0), tiny_model(0, "model.rope.fraction=1.0"))
    with pytest.raises(ConfigError, match="differ in n_layer"):
        weight_changes(tiny_model(0), tiny_model(0, "model.n_layer=1"))
