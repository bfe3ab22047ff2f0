"""The decoder itself: causality, the key/value cache, parameter accounting, ignored labels, hidden states,
layer RoPE sharing. (Logit parity with Hugging Face's Llama, Qwen3 and GPT-NeoX is in
tests/evaluate/test_hf_parity.py.)"""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import MODEL_PRESETS, ModelConfig, RopeConfig
from ropelab import layers
from ropelab import model as model_module
from ropelab.kv_cache import KVCache
from ropelab.model import Transformer, count_params_meta, model_summary

TINY = dict(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64)
BLOCKS = {
    "llama": {},
    "pythia": dict(block="parallel", norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True, tie_embeddings=False),
}


def _model(seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**TINY, **overrides})).eval()


@settings(max_examples=10, deadline=None)
@given(block=st.sampled_from(sorted(BLOCKS)), fraction=st.sampled_from([0.0, 0.25, 1.0]), cut=st.integers(1, 15),
       seed=st.integers(0, 2**16))
def test_logits_never_depend_on_later_tokens(block, fraction, cut, seed):
    model = _model(**BLOCKS[block], rope=RopeConfig(fraction=fraction))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 16), generator=g)
    changed = ids.clone()
    changed[:, cut:] = torch.randint(0, 97, (2, 16 - cut), generator=g)
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], rtol=0, atol=1e-6)


def _randomize(model: Transformer, seed: int = 0) -> Transformer:
    """Weights well away from the init (norms and biases too), so that logits are of order one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    return model


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("n_kv_head", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("fraction", [0.25, 1.0], ids=["partial", "full"])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_cached_forward_equals_the_full_forward(block, fraction, n_kv_head, documents):
    """Prefill, a chunk of three tokens, then one token at a time through a KVCache: the logits of the
    whole sequence in one forward, at every position."""
    model = _randomize(_model(**BLOCKS[block], n_kv_head=n_kv_head, rope=RopeConfig(fraction=fraction)))
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 4 + [1] * 12, [0] * 9 + [1] * 7]) if documents else None
    cache, pieces, start = KVCache(), [], 0
    with torch.no_grad():
        full, _ = model(ids, doc_ids=doc_ids)
        for end in (5, 8, *range(9, 17)):
            pieces.append(model(ids[:, start:end], doc_ids=None if doc_ids is None else doc_ids[:, :end],
                                kv_cache=cache)[0])
            start = end
    assert cache.get_seq_length() == 16 and len(cache.keys) == 2
    assert cache.keys[1].shape == (2, n_kv_head, 16, 8)
    assert full.abs().max() > 1  # logits far from zero: the tolerance below is tight
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_parameter_counts(block):
    model = _model(**BLOCKS[block])
    c = model.config
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(unique.values())
    embeddings = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    assert model.num_params(non_embedding=True) == model.num_params() - embeddings
    assert count_params_meta(c) == model.num_params()
    assert (model.lm_head.weight is model.embed.weight) == c.tie_embeddings
    assert model_summary(model)["params"] == model.num_params()


def test_shipped_small_presets_build_and_count_on_meta():
    """Every preset counts its parameters without allocating them; the two small ones also build."""
    for name, preset in MODEL_PRESETS.items():
        config = dataclasses.replace(preset, vocab_size=preset.vocab_size or 512)
        assert count_params_meta(config) > 0, name
    for name in ("tiny-llama", "tiny-pythia"):
        config = dataclasses.replace(MODEL_PRESETS[name], vocab_size=512)
        assert Transformer(config).num_params() == count_params_meta(config)


def test_loss_ignores_labels_of_minus_100_and_equals_cross_entropy():
    model = _model()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, dims=1)
    targets[:, ::3] = -100
    logits, loss = model(ids, targets)
    keep = targets != -100
    assert loss.item() == pytest.approx(F.cross_entropy(logits[keep], targets[keep]).item(), rel=1e-6)


def test_hidden_states_through_the_head_are_the_logits():
    model = _model()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, none = model(ids, return_hidden=True)
        logits, _ = model(ids)
    assert none is None and hidden.shape == (1, 10, 32)
    torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)


def test_layers_with_the_same_rope_share_one_module():
    model = _model(n_layer=3, rope_layers={1: {"fraction": 0.0}})
    assert len(model.ropes) == 2
    first, second, third = (block.attn.rope for block in model.blocks)
    assert first is third and first is not second and second.rotary_dims == 0


def test_init_and_vocab_required():
    model = _model(init_std=0.05)
    assert model.embed.weight.std().item() == pytest.approx(0.05, rel=0.1)
    assert all(torch.equal(b.attn_norm.weight, torch.ones(32)) for b in model.blocks)
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(ModelConfig(**{**TINY, "vocab_size": None}))



@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_a_model_built_for_loading_draws_nothing_and_computes_the_loaded_weights(block):
    reference = _model(seed=3, **BLOCKS[block])
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    empty = Transformer(ModelConfig(**{**TINY, **BLOCKS[block]}), init=False)
    assert torch.equal(torch.get_rng_state(), rng)  # no random draws: a loader's stream stays the caller's
    assert [n for n, _ in empty.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert all(p.device.type == "cpu" and not p.is_meta for p in empty.parameters())
    assert (empty.lm_head.weight is empty.embed.weight) == reference.config.tie_embeddings
    empty.load_state_dict(reference.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    assert torch.equal(empty.eval()(ids)[0], reference(ids)[0])
    with torch.device("meta"):  # the caller's device: a meta model stays one
        assert Transformer(ModelConfig(**TINY), init=False).embed.weight.is_meta

def _saved_activation_bytes(model: Transformer, ids: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward of the loss (what activation
    checkpointing leaves saved outside its recomputed regions)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids.roll(-1, dims=1))
    return sum(storages.values())


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_saves_less(block):
    model = _randomize(_model(**BLOCKS[block])).train()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    results, saved = {}, {}
    for mode in ("none", "mlp", "full"):
        model.set_activation_checkpointing(mode)
        model.zero_grad(set_to_none=True)
        _, loss = model(ids, ids.roll(-1, dims=1))
        loss.backward()
        results[mode] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        saved[mode] = _saved_activation_bytes(model, ids)
    for mode in ("mlp", "full"):
        assert all(torch.equal(a, b) for a, b in zip(results[mode], results["none"], strict=True)), mode
    assert saved["none"] > saved["mlp"] > saved["full"] > 0


def test_activation_checkpointing_leaves_a_kv_cache_and_no_grad_alone():
    model = _randomize(_model())
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, _ = model(ids)
    model.set_activation_checkpointing("full")
    cache = KVCache()
    logits, _ = model(ids[:, :6], kv_cache=cache)  # grad enabled: a recomputation would append again
    step, _ = model(ids[:, 6:], kv_cache=cache)
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(torch.cat([logits, step], dim=1), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'blocks'.*none, mlp, full"):
        model.set_activation_checkpointing("blocks")


def test_the_trainer_applies_activation_checkpointing_and_resumes_exactly(tmp_path, tiny_overrides, monkeypatch):
    """A run with train.activation_checkpointing=full, cut at step 4 and resumed, has the losses of an
    uninterrupted run without it (the same gradients, bit for bit)."""
    from ropelab.config import build_run_config
    from ropelab.train import checkpoint as ckpt
    from ropelab.train.loop import train
    from ropelab.train.metrics import read_metrics

    modes = []
    original = Transformer.set_activation_checkpointing
    monkeypatch.setattr(Transformer, "set_activation_checkpointing",
                        lambda self, mode: (modes.append(mode), original(self, mode))[1])
    train(build_run_config(overrides=tiny_overrides), tmp_path / "plain")
    part = tmp_path / "part"
    train(build_run_config(overrides=tiny_overrides + ["train.activation_checkpointing=full"]), part)
    assert modes == ["none", "full"]
    (ckpt.checkpoint_dir(part) / "step_00000008").rename(tmp_path / "dropped")  # as a crash after step 6 leaves it
    (part / "result.json").unlink()
    train(out_dir=part, resume=True)
    assert modes == ["none", "full", "full"]
    rows = [[(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run)]
            for run in (tmp_path / "plain", part)]
    assert rows[0] == rows[1] and len(rows[0]) == 8


def test_activation_checkpointing_setting_is_validated():
    from ropelab.config import ConfigError, build_run_config

    assert build_run_config().train.activation_checkpointing == "none"
    with pytest.raises(ConfigError) as info:
        build_run_config(overrides=["train.activation_checkpointing=blocks"])
    assert str(info.value) == "train.activation_checkpointing='blocks': must be one of 'none', 'mlp', 'full'"


FUSED = {"llama": {}, "llama-biases-qk-norm": dict(attn_bias=True, mlp_bias=True, qk_norm=True),
         "parallel-rmsnorm": dict(block="parallel"), "pythia": BLOCKS["pythia"]}


PRECISIONS = {"fp32": None, "bf16-autocast": torch.bfloat16}


def _autocast(precision: str):
    dtype = PRECISIONS[precision]
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("block", sorted(FUSED))
def test_fused_norm_and_projection_layers_train_as_the_plain_ones_bit_for_bit(block, precision, monkeypatch):
    """While training, a block's norms run inside its projections (ropelab.layers.rms_norm_linear,
    swiglu_linear), in fp32 and under bf16 autocast; with that switched off every op runs on its own
    (autocast casting the normalised input for each projection): the loss and every gradient match."""
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(layers, "fusable", lambda x: False)
            monkeypatch.setattr(model_module, "fusable", lambda x: False)
        model = _randomize(_model(**FUSED[block])).train()
        with _autocast(precision):
            _, loss = model(ids, ids.roll(-1, dims=1))
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_layers_train_as_the_plain_ones_under_cuda_autocast(dtype, monkeypatch):
    """The same on a GPU under CUDA autocast, to one rounding of its dtype (cuBLAS may pick other
    kernels for the fused layers' products than for the plain ones)."""
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5)).cuda()
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(layers, "fusable", lambda x: False)
            monkeypatch.setattr(model_module, "fusable", lambda x: False)
        model = _randomize(_model(**FUSED["llama-biases-qk-norm"])).cuda().train()
        with torch.autocast("cuda", dtype=dtype):
            _, loss = model(ids, ids.roll(-1, dims=1))
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    eps = torch.finfo(dtype).eps
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item())


# Bytes per token and layer that a Llama block keeps for backward (C d_model, F d_ff, H query heads, KD
# key/value width), when the norms run inside the projections. fp32: the block's input and middle
# residual, q, k, v, the attention output and its log-sum-exp, gate and up, and the two rstd. Under bf16
# autocast the residuals, the log-sum-exp and the rstd stay fp32, the projections' outputs are bf16.
SAVED_PER_TOKEN = {"fp32": lambda C, F_, H, KD: 4 * (4 * C + 2 * KD + 2 * F_ + H + 2),
                   "bf16-autocast": lambda C, F_, H, KD: 4 * (2 * C + H + 2) + 2 * (2 * C + 2 * KD + 2 * F_)}
# And per layer, whatever the length: under autocast the bf16 copies of the projections' weights (q and o
# C x C, k and v KD x C, gate, up and down F x C), as autocast keeps them; nothing in fp32.
SAVED_PER_LAYER = {"fp32": lambda C, F_, KD: 0,
                   "bf16-autocast": lambda C, F_, KD: 2 * (2 * C * C + 2 * KD * C + 3 * F_ * C)}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_a_llama_block_keeps_only_what_backward_cannot_recompute_cheaply(precision):
    """What a second layer adds at 2 x 24 and 2 x 48 tokens: per token (the slope) SAVED_PER_TOKEN, with
    no normalised input, no cast of it per projection and no silu(gate) * up; per layer SAVED_PER_LAYER."""
    config = dict(block="sequential", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2, d_model=32, d_ff=48)

    def layer_bytes(seq: int) -> int:
        ids = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(6))
        with _autocast(precision):
            one, two = (_saved_activation_bytes(_model(**config, n_layer=n).train(), ids) for n in (1, 2))
        return two - one

    short, long = layer_bytes(24), layer_bytes(48)
    per_token = (long - short) / (2 * 24)
    assert per_token == SAVED_PER_TOKEN[precision](32, 48, 4, 2 * 8)
    assert short - 2 * 24 * per_token == SAVED_PER_LAYER[precision](32, 48, 2 * 8)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_an_inference_forward_works_in_place_only_on_tensors_no_hook_kept(qk_norm):
    """Without grad, q and k are rotated and silu(gate) * up formed in place: the logits are those of the
    forward that makes new tensors (a hooked one; the CPU RoPE kernel gives the reference's bits, the torch
    rotation differs in the last bit), and a tensor a hook kept is never changed afterwards."""
    config = ModelConfig(vocab_size=97, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, qk_norm=qk_norm,
                         rope=RopeConfig(fraction=0.5))
    model = Transformer(config).eval()
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        in_place = model(idx)[0]
    kept = []

    def keep(module, inputs, output):
        kept.append((module, inputs[0], output))

    blocks = model.blocks
    handles = [m.register_forward_hook(keep) for b in blocks for m in (b.attn.q_proj, b.attn.k_proj, b.attn.q_norm,
                                                                       b.attn.k_norm, b.mlp.gate_proj, b.mlp.up_proj)]
    with torch.no_grad():
        hooked = model(idx)[0]
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(in_place, hooked, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        for module, given, output in kept:
            assert torch.equal(output, module(given)), module


def test_a_phase_theta_set_in_model_position_survives_a_config_round_trip():
    """set_rope (a phase's switch) keeps the model's config in step with its modules where the theta sits
    in `model.position`, so what remote-code export writes (the config as a dict) reads back to it."""
    from ropelab.config.coerce import from_dict

    def config(theta):
        return ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, n_kv_head=1, d_ff=64,
                           position=[{"type": "rope", "theta": theta}])

    model = Transformer(config(500.0))
    model.set_rope(config(1e6))
    rebuilt = from_dict(ModelConfig, dataclasses.asdict(model.config), "model")
    assert [rebuilt.rope_for_layer(layer).theta for layer in range(2)] == [1e6, 1e6]
    assert [block.attn.rope.theta for block in model.blocks] == [1e6, 1e6]
