"""A plan applied to a full-RoPE model's weights: all pairs give the source, none give NoPE, any plan gives
the source with the dropped pairs' rotation removed (frequency 0), in both layouts, with GQA and QK-Norm."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ConfigError, ModelConfig, RopeConfig
from ropelab.model import Transformer
from ropelab.rope import RotaryEmbedding, inverse_frequencies
from ropelab.sources.plans import apply_plan, check_source, needs_scores, resolve_plans, target_config
from tests.helpers import assert_logits_match, largest_attention_score

D, N_PAIRS, LAYERS, KV = 16, 8, 3, 2


def source_model(layout: str = "half", qk_norm: bool = False, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=97, n_layer=LAYERS, d_model=64, n_head=4, n_kv_head=KV, d_ff=96, qk_norm=qk_norm,
                         attn_bias=True, rope=RopeConfig(theta=100.0, layout=layout))
    model = Transformer(config).eval()
    with torch.no_grad():  # weights far from their init, so that every pair matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def convert(model: Transformer, keep: int, select: str, explicit=None, scores=None) -> Transformer:
    plans, config = resolve_plans(target_config(model.config, keep, select, explicit), scores)
    return apply_plan(model, config, plans).eval()


def zeroed_frequencies(model: Transformer, plans) -> Transformer:
    """The source whose dropped pairs turn at frequency 0 (angle 0: no rotation), per layer and KV head."""
    ref = copy.deepcopy(model)
    spectrum = inverse_frequencies(D, D, model.config.rope.theta)
    for layer, block in enumerate(ref.blocks):
        rope = RotaryEmbedding(copy.deepcopy(model.config.rope), D, KV)
        mask = torch.zeros(KV, N_PAIRS, dtype=torch.float64)
        for head in range(KV):
            mask[head, plans[layer][head]] = 1
        rope.inv_freq = spectrum * mask
        block.attn.rope = rope
    return ref


TOKENS = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("select", ["high", "2-norm"])
def test_keeping_every_pair_gives_the_source(layout, select):
    model = source_model(layout)
    scores = [torch.rand(KV, N_PAIRS) for _ in range(LAYERS)]
    converted = convert(model, N_PAIRS, select, scores=scores)
    assert_logits_match(converted(TOKENS)[0], model(TOKENS)[0], model.config,  # q.k summed in another order
                        scores=largest_attention_score(model, TOKENS))


def test_keeping_no_pair_is_nope():
    model = source_model()
    converted = convert(model, 0, "high")
    config = copy.deepcopy(model.config)
    config.rope.fraction = 0.0
    nope = Transformer(config)
    nope.load_state_dict(model.state_dict())
    assert converted.ropes[0].rotary_dims == 0
    assert torch.equal(converted(TOKENS)[0], nope.eval()(TOKENS)[0])


@settings(max_examples=6, deadline=None)
@given(st.data(), st.sampled_from(["half", "interleaved"]), st.booleans())
def test_any_plan_is_the_source_without_the_dropped_rotations(data, layout, qk_norm):
    model = source_model(layout, qk_norm, seed=data.draw(st.integers(0, 3)))
    r = data.draw(st.integers(1, N_PAIRS - 1))
    draw = lambda: sorted(data.draw(st.permutations(range(N_PAIRS)))[:r])  # noqa: E731
    explicit = [draw() if qk_norm else [draw() for _ in range(KV)] for _ in range(LAYERS)]
    converted = convert(model, r, "list", explicit)
    plans = [[p] * KV if qk_norm else p for p in explicit]
    ref = zeroed_frequencies(model, plans)
    assert_logits_match(converted(TOKENS)[0], ref(TOKENS)[0], model.config, scores=largest_attention_score(ref, TOKENS))
    converted.train(), ref.train()
    converted(TOKENS, TOKENS)[1].backward()
    ref(TOKENS, TOKENS)[1].backward()
    for name in ("blocks.0.attn.v_proj.weight", "blocks.2.mlp.up_proj.weight", "embed.weight"):
        got, want = converted.get_parameter(name).grad, ref.get_parameter(name).grad
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5 * float(want.abs().max()))  # float32 sums


def test_two_norm_scores_are_written_into_the_config_per_layer():
    model = source_model()
    scores = [torch.arange(KV * N_PAIRS, dtype=torch.float64).reshape(KV, N_PAIRS).flip(-1) * (layer + 1)
              for layer in range(LAYERS)]
    target = target_config(model.config, 3, "2-norm")
    assert needs_scores(target)
    plans, config = resolve_plans(target, scores)
    assert plans[0] == [[0, 1, 2], [0, 1, 2]]
    assert not needs_scores(config) and config.rope_for_layer(1).pairs == [0, 1, 2]
    with pytest.raises(ConfigError, match="needs calibration scores"):
        resolve_plans(target)


def test_a_layer_with_its_own_position_list_gets_its_two_norm_pairs_there():
    import dataclasses

    model = source_model()
    scores = [torch.arange(KV * N_PAIRS, dtype=torch.float64).reshape(KV, N_PAIRS) for _ in range(LAYERS)]
    own = [{"type": "rope", "keep_pairs": 2, "select": "2-norm"}, {"type": "alibi"}]
    target = dataclasses.replace(model.config, position_layers={1: own})
    plans, config = resolve_plans(target, scores)  # validated: no model.rope_layers.1 beside the layer's list
    assert config.rope_for_layer(1).pairs == [N_PAIRS - 2, N_PAIRS - 1] and not config.rope_layers
    assert [entry.type.name for entry in config.positions_for_layer(1)] == ["rope", "alibi"]
    assert plans[1] == [[N_PAIRS - 2, N_PAIRS - 1]] * KV and plans[0] == [list(range(N_PAIRS))] * KV


def test_qk_norm_models_keep_one_plan_per_layer():
    model = source_model(qk_norm=True)
    scores = [torch.tensor([[9.0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 5, 9]])] * LAYERS
    plans, _ = resolve_plans(target_config(model.config, 2, "2-norm"), scores)
    assert plans[0] == [[0, 7], [0, 7]]  # summed over the KV heads: 9, 0, ..., 5, 10
    with pytest.raises(ConfigError, match="every KV head keeps the same"):
        convert(model, 1, "list", [[[0], [1]]] * LAYERS)


def test_bad_sources_and_plans_are_one_line():
    model = source_model()
    with pytest.raises(ConfigError, match="3 layers"):
        target_config(model.config, 2, "list", [[0, 1]] * 2)
    with pytest.raises(ConfigError, match=r"rope.pairs\[1\]"):
        target_config(model.config, 2, "list", [[0, 1], [0, 9], [0, 1]])
    nope = copy.deepcopy(model.config)
    nope.rope_layers = {1: {"fraction": 0.0}}
    with pytest.raises(ConfigError, match="src: layer 1 has no RoPE"):
        check_source(nope, "src")
    partial = copy.deepcopy(model.config)
    partial.rope.fraction = 0.5
    with pytest.raises(ConfigError, match="rotates 8 of its 16 channels"):
        check_source(partial, "src")
