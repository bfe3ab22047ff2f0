"""Multi-head latent attention: exact at full rank, the absorbed cache path against the materialised one,
what the cache holds, and the config's one-line refusals."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ConfigError, LayerKind, ModelConfig
from ropelab.config.mla import MLAConfig, cached_values, full_rank
from ropelab.kv_cache import KVCache
from ropelab.mla.attention import latent_cache_values, set_absorb
from ropelab.mla.convert import head_latent, latent_model, split_ranks
from ropelab.model import Transformer
from ropelab.sources.plans import apply_plan, resolve_plans, target_config
from tests.helpers import randomize_weights

D = 16


def tiny(**kw) -> ModelConfig:
    return ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128, vocab_size=100, **kw)


def planned(keep: int, **kw) -> Transformer:
    """A random tiny full-RoPE model turned to keep `keep` fastest pairs per KV head (the convert path)."""
    torch.manual_seed(0)
    config = tiny(**kw)
    source = randomize_weights(Transformer(config)).eval()
    plans, new = resolve_plans(target_config(config, keep, "high"))
    return apply_plan(source, new, plans).eval()


IDS = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("keep", [8, 3, 0])
@pytest.mark.parametrize("init", ["svd-joint", "svd-split"])
@pytest.mark.parametrize("bias", [False, True])
def test_full_rank_gives_the_planned_models_logits(keep, init, bias):
    model = planned(keep, attn_bias=bias)
    converted = latent_model(model, full_rank(64, D, 2 * keep), init).eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(IDS)[0], model(IDS)[0], rtol=0, atol=2e-5)


def test_a_lower_rank_changes_the_logits_and_the_split_differs_from_the_joint():
    model = planned(2)
    with torch.no_grad():
        reference = model(IDS)[0]
        joint, split = (latent_model(model, 6, init).eval()(IDS)[0] for init in ("svd-joint", "svd-split"))
    assert (joint - reference).abs().max() > 1e-3 and (joint - split).abs().max() > 1e-3


@settings(max_examples=25, deadline=None)
@given(nope=st.integers(0, 6), head_dim=st.integers(1, 6), d_model=st.integers(1, 14),
       init=st.sampled_from(["svd-joint", "svd-split"]), seed=st.integers(0, 2**16))
def test_one_head_at_full_rank_is_reproduced_exactly(nope, head_dim, d_model, init, seed):
    g = torch.Generator().manual_seed(seed)
    w_nope, w_v = torch.randn(nope, d_model, generator=g).double(), torch.randn(head_dim, d_model, generator=g).double()
    rank = min(d_model, nope + head_dim)
    if init == "svd-split" and sum(split_ranks(rank, nope, head_dim, d_model)) != min(d_model, nope) + min(d_model, head_dim):
        rank = sum(split_ranks(rank, nope, head_dim, d_model))  # split's own full rank when d_model is the bound
    k_up, v_up, down = head_latent(w_nope, w_v, rank, init)
    assert k_up.shape == (nope, rank) and v_up.shape == (head_dim, rank) and down.shape == (rank, d_model)
    if init == "svd-joint" or rank == min(d_model, nope) + min(d_model, head_dim):
        torch.testing.assert_close(k_up @ down, w_nope, rtol=0, atol=1e-9)
        torch.testing.assert_close(v_up @ down, w_v, rtol=0, atol=1e-9)


def generate(model, absorb: bool, steps: int = 8):
    """Greedy tokens and the logits of every step, the prompt once and then one token at a time."""
    set_absorb(model, absorb)
    cache, ids, logits = KVCache(), IDS[:, :10], []
    with torch.no_grad():
        step_logits = model(ids, kv_cache=cache)[0][:, -1]
        for _ in range(steps):
            logits.append(step_logits)
            token = step_logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            step_logits = model(token, kv_cache=cache)[0][:, -1]
    return ids, torch.stack(logits, 1), cache


@pytest.mark.parametrize("bias", [False, True])
def test_absorbed_decoding_gives_the_materialised_tokens_and_logits(bias):
    model = latent_model(planned(2, attn_bias=bias), 5).eval()
    absorbed_ids, absorbed, cache = generate(model, True)
    materialised_ids, materialised, _ = generate(model, False)
    assert torch.equal(absorbed_ids, materialised_ids)
    torch.testing.assert_close(absorbed, materialised, rtol=0, atol=1e-4)
    with torch.no_grad():  # and both are the cacheless forward over the whole sequence
        whole = model(absorbed_ids[:, :-1])[0][:, 9:]
    torch.testing.assert_close(absorbed, whole, rtol=0, atol=1e-4)
    # the cache held the rotated pairs and the latent only: (B, K, tokens, 2r) and (B, K, tokens, d)
    assert [tuple(t.shape) for t in (cache.keys[0], cache.values[0])] == [(2, 2, 18, 4), (2, 2, 18, 5)]


def test_a_sliding_window_layer_keeps_its_window_of_latents():
    model = planned(2)
    config = dataclasses.replace(model.config, layer_pattern="LS",
                                 layer_kinds={"L": LayerKind(), "S": LayerKind(attention="sliding", window=6)})
    windowed = Transformer(config, init=False)
    windowed.load_state_dict(model.state_dict())
    converted = latent_model(windowed.eval(), 7).eval()
    ids, absorbed, cache = generate(converted, True)
    _, materialised, _ = generate(converted, False)
    torch.testing.assert_close(absorbed, materialised, rtol=0, atol=1e-4)
    assert cache.values[0].shape[2] == 18 and cache.values[1].shape[2] == 5


def test_the_cache_counts_and_training_reaches_every_weight():
    model = latent_model(planned(2), 8)
    assert latent_cache_values(model) == 2 * 2 * cached_values(8, 4) and latent_cache_values(planned(2)) == 2 * 2 * 2 * D
    model.train()
    loss = model(IDS[:, :-1], targets=IDS[:, 1:])[1]
    loss.backward()
    attn = model.blocks[0].attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in (attn.kr_proj.weight, attn.kv_down.weight, attn.k_up.weight, attn.v_up.weight))


@pytest.mark.parametrize("changes, message", [
    ({"mla": MLAConfig(rank=0)}, r"model.mla.rank=0: must be an integer >= 1"),
    ({"mla": MLAConfig(rank=29)}, r"model.mla.rank=29: above full rank 28 for layer 0 .*= 28\)"),
    ({"mla": MLAConfig(rank=4), "qk_norm": True}, "model.mla: not with model.qk_norm"),
    ({"mla": MLAConfig(rank=4), "position": [{"type": "rope"}, {"type": "alibi"}]}, "model.mla: layer 0 is"),
])
def test_bad_mla_settings_are_one_line(changes, message):
    config = dataclasses.replace(planned(2).config, **changes)
    with pytest.raises(ConfigError, match=message) as error:
        config.validate()
    assert "\n" not in str(error.value)


def test_kv_heads_keeping_different_pairs_decode_alike_absorbed_and_materialised():
    torch.manual_seed(0)
    config = tiny()
    source = randomize_weights(Transformer(config)).eval()
    plans, new = resolve_plans(target_config(config, 2, "list", [[[0, 5], [2, 7]], [[1, 3], [4, 6]]]))
    model = latent_model(apply_plan(source, new, plans).eval(), 6).eval()
    assert model.blocks[0].attn.rope.per_head
    absorbed_ids, absorbed, _ = generate(model, True)
    materialised_ids, materialised, _ = generate(model, False)
    assert torch.equal(absorbed_ids, materialised_ids)
    torch.testing.assert_close(absorbed, materialised, rtol=0, atol=1e-4)
    with torch.no_grad():  # the cacheless forward rotates whole key heads: the same per-head angles
        torch.testing.assert_close(absorbed, model(absorbed_ids[:, :-1])[0][:, 9:], rtol=0, atol=1e-4)
