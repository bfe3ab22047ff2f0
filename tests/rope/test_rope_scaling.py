"""RoPE scaling (context extension) on exactly the rotated pairs: parity with transformers'
`modeling_rope_utils` (frequencies rel. <= 1e-6, fp32 logits within what rounding explains:
tests/helpers.py's parity_tolerance), hand-computed frequencies
for spectra HF does not have (truncate, selected pairs), the model wiring, interchange and refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ropelab.config import ConfigError, ModelConfig, PhaseConfig, RopeConfig, RopeScalingConfig, build_run_config
from ropelab.model import Transformer
from ropelab.rope import RotaryEmbedding, inverse_frequencies, layer_frequencies, rope_angles
from ropelab.rope.scaling import scale_frequencies
from tests.helpers import assert_logits_match, randomize_weights

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

REL = 1e-6
HEAD_DIM = 64
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
# (HF rope_parameters, RopeScalingConfig fields), both without the per-pair lists of longrope
METHODS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, dict(method="linear", factor=4.0)),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0},
                dict(method="dynamic", factor=4.0, original_max_position=2048)),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024},
             dict(method="yarn", factor=8.0, original_max_position=1024)),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
                     "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
                    dict(method="yarn", factor=16.0, original_max_position=4096, beta_fast=16.0, beta_slow=2.0,
                         mscale=0.707, mscale_all_dim=1.0, truncate=False)),
    "yarn-attention": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                        "attention_factor": 0.8}, dict(method="yarn", factor=4.0, original_max_position=512,
                                                       attention_factor=0.8)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0}, dict(method="llama3", factor=8.0, original_max_position=1024)),
    "longrope": ({"rope_type": "longrope", "factor": 16.0, "original_max_position_embeddings": 1024},
                 dict(method="longrope", factor=16.0, original_max_position=1024)),
}


def _hf_frequencies(params: dict, theta: float, pct: float, seq_len=None, max_positions: int = 2048):
    """transformers' own inverse frequencies and attention factor for one rope type."""
    params = dict(params, rope_theta=theta, partial_rotary_factor=pct)
    if params["rope_type"] == "longrope":
        n = int(HEAD_DIM * pct) // 2
        params |= {"short_factor": SHORT[:n], "long_factor": LONG[:n]}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM,
                                      max_position_embeddings=max_positions, rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv_freq.double(), factor


def _scaling(fields: dict, rotary_dims: int) -> RopeScalingConfig:
    if fields["method"] == "longrope":
        fields = fields | {"short_factor": SHORT[: rotary_dims // 2], "long_factor": LONG[: rotary_dims // 2]}
    return RopeScalingConfig(**fields)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b) / b).abs().max().item()


# ------------------------------------------------------------------ frequencies: HF parity


@pytest.mark.parametrize("pct", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
@pytest.mark.parametrize("method", list(METHODS))
def test_frequencies_and_attention_factor_equal_hf(method, theta, pct):
    params, fields = METHODS[method]
    r = int(HEAD_DIM * pct)
    scaling = _scaling(fields, r)
    lengths = [None, 1000, 2048, 2049, 5000, 40_000] if method in ("dynamic", "longrope") else [None]
    base = inverse_frequencies(r, HEAD_DIM, theta)
    for seq_len in lengths:
        theirs, their_factor = _hf_frequencies(params, theta, pct, seq_len)
        ours, our_factor = scale_frequencies(base, r, theta, scaling, seq_len)
        assert ours.shape == (r // 2,) and ours.dtype == torch.float64
        assert _rel(ours, theirs) <= REL, seq_len
        assert our_factor == pytest.approx(their_factor, rel=1e-12), seq_len
        if method != "dynamic" or (seq_len or 0) > scaling.original_max_position:
            assert _rel(ours, base) > 1e-3  # the method did change something here: the comparison can fail


def test_dynamic_is_the_identity_up_to_the_original_length_and_grows_beyond():
    scaling = RopeScalingConfig("dynamic", 4.0, 2048)
    base = inverse_frequencies(32, HEAD_DIM, 10_000.0)
    for seq_len in (None, 1, 2048):
        assert _rel(scale_frequencies(base, 32, 10_000.0, scaling, seq_len)[0], base) <= 1e-14
    slowest = [scale_frequencies(base, 32, 10_000.0, scaling, n)[0][-1].item() for n in (2049, 4096, 16_384)]
    assert slowest[0] > slowest[1] > slowest[2]  # longer context, slower pairs
    assert scale_frequencies(base, 32, 10_000.0, scaling, torch.tensor(4096))[0].tolist() == \
        scale_frequencies(base, 32, 10_000.0, scaling, 4096)[0].tolist()  # a traced length gives the same numbers


# ------------------------------------------------------------------ frequencies: truncate and selected pairs


def _yarn_by_hand(i: int, dim: int, theta: float, factor: float, original: int, beta_fast=32.0, beta_slow=1.0):
    """YaRN's frequency of pair i of the spectrum theta^(-2i/dim), from the paper's formulas with HF's rounding."""
    low = math.floor(dim * math.log(original / (beta_fast * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(dim * math.log(original / (beta_slow * 2 * math.pi)) / (2 * math.log(theta)))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    f = theta ** (-2 * i / dim)
    return f * (1 - ramp) + f / factor * ramp


def test_yarn_on_a_truncate_spectrum_by_hand():
    rope = RopeConfig(fraction=0.25, style="truncate", theta=10_000.0,
                      scaling=RopeScalingConfig("yarn", 4.0, 256))
    ours = layer_frequencies(rope, HEAD_DIM)
    # dim = head_dim: pairs 0..7 of the full-head spectrum; low = floor(0.84) = 0, high = ceil(12.88) = 13
    expected = [_yarn_by_hand(i, HEAD_DIM, 10_000.0, 4.0, 256) for i in range(8)]
    assert ours.tolist() == pytest.approx(expected, rel=1e-12)
    assert expected[0] == 1.0 and expected[7] == pytest.approx(10_000 ** (-14 / 64) * (1 - 7 / 13 * 0.75), rel=1e-12)
    # the same numbers as HF's full-RoPE YaRN, restricted to the rotated pairs
    theirs, _ = _hf_frequencies({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                                10_000.0, 1.0)
    assert _rel(ours, theirs[:8]) <= REL
    slice_rope = dataclasses.replace(rope, style="slice")  # the slice spectrum differs: so does its YaRN
    assert _rel(layer_frequencies(slice_rope, HEAD_DIM), ours) > 0.1


def test_yarn_on_selected_pairs_by_hand():
    pairs = [[0, 5, 11, 20, 31], [1, 2, 3, 30, 31]]  # one list per KV head
    rope = RopeConfig(pairs=pairs, theta=500_000.0, scaling=RopeScalingConfig("yarn", 8.0, 512))
    ours = layer_frequencies(rope, HEAD_DIM, kv_heads=2)
    assert ours.shape == (2, 5)
    expected = [[_yarn_by_hand(i, HEAD_DIM, 500_000.0, 8.0, 512) for i in head] for head in pairs]
    assert ours.tolist()[0] == pytest.approx(expected[0], rel=1e-12)
    assert ours.tolist()[1] == pytest.approx(expected[1], rel=1e-12)
    theirs, _ = _hf_frequencies({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
                                500_000.0, 1.0)
    assert _rel(ours, theirs[torch.tensor(pairs)]) <= REL


@settings(max_examples=30, deadline=None)
@given(pairs=st.sets(st.integers(0, HEAD_DIM // 2 - 1), min_size=1, max_size=HEAD_DIM // 2),
       method=st.sampled_from(["linear", "ntk", "dynamic", "yarn", "llama3"]),
       factor=st.floats(1.01, 64.0), theta=st.sampled_from([100.0, 10_000.0, 1e6]))
def test_scaling_a_subset_of_the_full_head_spectrum_keeps_its_numbers(pairs, method, factor, theta):
    """A selected-pair plan gets the very frequencies its pairs have under full-RoPE scaling."""
    scaling = RopeScalingConfig(method, factor, 256)
    full = layer_frequencies(RopeConfig(theta=theta, scaling=scaling), HEAD_DIM)
    kept = sorted(pairs)
    subset = layer_frequencies(RopeConfig(pairs=kept, theta=theta, scaling=scaling), HEAD_DIM)
    torch.testing.assert_close(subset, full[kept], rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None)
@given(method=st.sampled_from(["linear", "ntk", "yarn", "llama3"]), r=st.sampled_from([4, 16, 64]),
       theta=st.sampled_from([100.0, 10_000.0, 500_000.0]), seq_len=st.integers(1, 100_000))
def test_factor_to_one_is_no_scaling(method, r, theta, seq_len):
    """(Not dynamic NTK: at factor 1 its base still grows, as (L / original)^(dim/(dim-2)).)"""
    base = inverse_frequencies(r, HEAD_DIM, theta)
    ours, factor = scale_frequencies(base, r, theta, RopeScalingConfig(method, 1 + 1e-9, 256), seq_len)
    torch.testing.assert_close(ours, base, rtol=1e-7, atol=0)
    assert factor == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(factor=st.floats(1.01, 100.0), start=st.integers(0, 1_000_000))
def test_linear_scaling_is_dividing_positions(factor, start):
    """Position interpolation: the layer's cos/sin at position p are plain RoPE's at p / factor."""
    emb = RotaryEmbedding(RopeConfig(scaling=RopeScalingConfig("linear", factor)), 16)
    positions = torch.arange(start, start + 8)[None]
    cos, sin = emb.cos_sin(positions)
    expected = rope_angles(positions.double() / factor, inverse_frequencies(16, 16, 10_000.0))
    torch.testing.assert_close(cos[0, 0], expected[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, 0], expected[1][0], rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the model: cos/sin, caching, phases


def _rotary(scaling, **rope) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(scaling=scaling, **rope), 16)


def test_attention_factor_reaches_the_rotated_channels_only():
    yarn = RopeScalingConfig("yarn", 8.0, 16)
    emb = _rotary(yarn, fraction=0.5)
    q, k = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    positions = torch.arange(6)[None]
    qs, ks = emb(q.clone(), k.clone(), positions)
    factor = 0.1 * math.log(8) + 1
    assert emb.attention_factor == pytest.approx(factor)
    assert torch.equal(qs[..., 8:], q[..., 8:]) and torch.equal(ks[..., 8:], k[..., 8:])  # pass-through untouched
    torch.testing.assert_close(qs[..., :8].norm(dim=-1), q[..., :8].norm(dim=-1) * factor)
    plain = _rotary(None, fraction=0.5)
    plain.inv_freq = emb.inv_freq
    qp, kp = plain(q.clone(), k.clone(), positions)
    torch.testing.assert_close(qs[..., :8] @ ks[..., :8].transpose(-1, -2),
                               (qp[..., :8] @ kp[..., :8].transpose(-1, -2)) * factor ** 2)


@pytest.mark.parametrize("cache", ["table", "none"])
def test_dynamic_frequencies_follow_each_calls_length(cache):
    dynamic = RopeScalingConfig("dynamic", 4.0, 8)
    emb = _rotary(dynamic, cache=cache)
    base = inverse_frequencies(16, 16, 10_000.0)
    q, k = torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
    for length in (5, 20, 12, 6, 20):
        positions = torch.arange(length)[None]
        cos, sin = emb.cos_sin(positions)
        expected = scale_frequencies(base, 16, 10_000.0, dynamic, length)[0]
        torch.testing.assert_close(emb.inv_freq, expected, rtol=1e-14, atol=0)
        torch.testing.assert_close(cos[0, 0], rope_angles(torch.arange(length), expected)[0])
        if cache == "table":  # one table, as long as the length beyond the original context (or grown to it)
            assert emb.cos_table.shape[0] == (length if length > 8 else emb.cos_table.shape[0])
        emb(q[:, :, :length].clone(), k[:, :, :length].clone(), positions)
    emb.set_theta(500.0)
    emb.cos_sin(torch.arange(20)[None])
    torch.testing.assert_close(emb.inv_freq, scale_frequencies(inverse_frequencies(16, 16, 500.0), 16, 500.0,
                                                               dynamic, 20)[0], rtol=1e-14, atol=0)


def test_traced_length_gives_the_same_cos_sin(monkeypatch):
    """Under torch.compile the length is a tensor (no graph break); the numbers are those of the table."""
    longrope = RopeScalingConfig("longrope", 4.0, 8, short_factor=[1.0] * 8, long_factor=[3.0] * 8)
    for scaling in (RopeScalingConfig("dynamic", 4.0, 8), longrope):
        emb, positions = _rotary(scaling), torch.arange(3, 19)[None]
        eager = emb.cos_sin(positions)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        traced = emb.cos_sin(positions.clone())
        monkeypatch.undo()
        torch.testing.assert_close(traced, eager)


def test_kernel_forming_angles_from_frequencies_falls_back_with_an_attention_factor(monkeypatch):
    class Triton:  # stands in for rope.triton_kernel: it would form cos/sin from inv_freq without the factor
        @staticmethod
        def supports(*args):
            return True

        rotate_qk_ = None

    monkeypatch.setattr("ropelab.rope.embedding.triton_kernels", lambda: Triton)
    q, k, positions = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), torch.arange(4)[None]
    assert _rotary(RopeScalingConfig("yarn", 4.0, 8), cache="none")._kernel_rotation(q, k, positions) is None
    assert _rotary(RopeScalingConfig("linear", 4.0), cache="none")._kernel_rotation(q, k, positions) is not None


def test_set_scaling_switches_on_yarn_like_a_model_built_with_it():
    config = ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, d_ff=64, max_seq_len=64)
    yarn = RopeScalingConfig("yarn", 4.0, 16)
    model = randomize_weights(Transformer(config))
    built = Transformer(dataclasses.replace(config, rope=RopeConfig(scaling=yarn))).eval()
    built.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        before = model(idx)[0]
        for rope in model.ropes:
            rope.set_scaling(yarn)
        after = model(idx)[0]
        assert (after - before).abs().max() > 1e-3  # YaRN changes the logits: the comparisons below can fail
        torch.testing.assert_close(after, built(idx)[0], rtol=0, atol=1e-6)
        for rope in model.ropes:
            rope.set_scaling(None)
        torch.testing.assert_close(model(idx)[0], before, rtol=0, atol=1e-6)


def test_phase_may_switch_scaling_on():
    config = build_run_config(overrides=[
        "train.phases=[{name: short, steps: 2}, {name: long, steps: 2}]",
        "train.phases[1].overrides.model.rope.scaling.method=yarn",
        "train.phases[1].overrides.model.rope.scaling.factor=4",
        "train.phases[1].overrides.model.rope.scaling.original_max_position=256",
        "train.phases[1].overrides.data.seq_len=1024",
    ])
    from ropelab.train.phases import resolve_phases

    short, long = resolve_phases(config)
    assert short.config.model.rope.scaling is None
    assert long.config.model.rope.scaling == RopeScalingConfig("yarn", 4.0, 256)
    assert "model.rope.scaling" in PhaseConfig.MODEL_KEYS
    with pytest.raises(ConfigError, match=r"train.phases\[1\] \(long\): model.rope.scaling.factor=0.5: must be"):
        resolve_phases(build_run_config(overrides=[
            "train.phases=[{name: short, steps: 2}, {name: long, steps: 2}]",
            "train.phases[1].overrides.model.rope.scaling={method: yarn, factor: 0.5, original_max_position: 8}",
        ]))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("overrides, message", [
    (["model.rope.scaling.method=yarn2"], r"model.rope.scaling.method='yarn2': must be one of 'linear', 'ntk'"),
    (["model.rope.scaling.factor=2"], r"model.rope.scaling.method: required; one of linear, ntk, dynamic"),
    (["model.rope.scaling={method: yarn, factor: 0.5, original_max_position: 256}"],
     r"model.rope.scaling.factor=0.5: must be a finite number > 1 for yarn"),
    (["model.rope.scaling={method: linear, factor: 1}"], r"model.rope.scaling.factor=1.0: must be a finite number > 1"),
    (["model.rope.scaling={method: yarn, factor: 4}"],
     r"model.rope.scaling.original_max_position=None: must be an integer"),
    (["model.rope.scaling={method: yarn, factor: 4, original_max_position: 256, beta_fast: 1, beta_slow: 2}"],
     r"model.rope.scaling.beta_fast=1.0: must be > beta_slow=2.0 > 0"),
    (["model.rope.fraction=0.25", "model.rope.scaling={method: longrope, factor: 4, original_max_position: 256, "
      "short_factor: [1, 1, 1, 1, 1, 1, 1, 1], long_factor: [1, 2, 3]}"],
     r"model.rope.scaling.long_factor: 3 values but the layer rotates 8 pairs \(rotary_dims/2 = 16/2\)"),
    (["model.rope.fraction=0", "model.rope.scaling={method: linear, factor: 2}"],
     r"model.rope.scaling.method=linear: the layer is NoPE \(rotary_dims 0\)"),
    (["model.rope.scaling={method: linear, factor: 2}", "model.rope_layers={1: {fraction: 0}}"],
     r"model.rope_layers.1.scaling.method=linear: the layer is NoPE"),
    (["model.rope.rotary_dims=2", "model.rope.scaling={method: ntk, factor: 2}"],
     r"model.rope.scaling.method=ntk: needs a spectrum of at least 4 channels"),
    (["model.rope.scaling={method: llama3, factor: 8, original_max_position: 64, low_freq_factor: 4, "
      "high_freq_factor: 1}"], r"model.rope.scaling.high_freq_factor=1.0: must be > low_freq_factor=4.0"),
], ids=["unknown-method", "no-method", "factor-below-1", "factor-1", "no-original", "betas", "longrope-length",
        "nope", "nope-layer", "ntk-2-dims", "llama3-factors"])
def test_bad_scaling_is_one_config_error_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_run_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_scaling_from_yaml_and_per_layer():
    config = build_run_config({"model": {"rope": {"fraction": 0.5, "scaling": {
        "method": "llama3", "factor": 8, "original_max_position": 1024}}, "rope_layers": {1: {"scaling": None}}}})
    assert config.model.rope.scaling == RopeScalingConfig("llama3", 8.0, 1024)
    assert config.model.rope_for_layer(1).scaling is None
    model = Transformer(dataclasses.replace(config.model, vocab_size=64, n_layer=2, d_model=32, n_head=2))
    assert [r.attention_factor for r in model.ropes] == [1.0, 1.0] and model.ropes[0].inv_freq[-1] < \
        model.ropes[1].inv_freq[-1]


# ------------------------------------------------------------------ Hugging Face models: logits

from ropelab.sources.hf import from_hf, to_hf  # noqa: E402
from ropelab.sources.hf_config_write import hf_architecture  # noqa: E402

VOCAB, T = 128, 24
HF_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=16)
# original context 8 or 16 (max_position_embeddings, for dynamic): 24 tokens run beyond it
LLAMA_TYPES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 8},
    "llama3": {"factor": 8.0, "original_max_position_embeddings": 8, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"factor": 4.0, "original_max_position_embeddings": 8, "short_factor": SHORT[:8],
                 "long_factor": LONG[:8]},
}


def _hf_model(class_name: str, config_name: str, **kwargs):
    config = getattr(transformers, config_name)(**HF_COMMON, **kwargs)
    model = getattr(transformers, class_name)._from_config(config, dtype=torch.float32, attn_implementation="eager")
    return randomize_weights(model)


def _assert_same_logits(ours, theirs, length: int = T, angles_differ: bool = True) -> None:
    """`angles_differ`: theirs is transformers' (RoPE angles in float32), not ropelab's code."""
    idx = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_match(ours(idx)[0], theirs(input_ids=idx).logits, ours.config, angles_differ)


def _assert_scaling_matters(ours, theirs) -> None:
    """Without its scaling `ours` fails the comparison at 24 tokens: the comparison can fail."""
    with pytest.raises(AssertionError, match="logits differ"):
        _assert_same_logits(_unscaled(ours), theirs)


def _unscaled(model: Transformer) -> Transformer:
    plain = Transformer(dataclasses.replace(model.config, rope=dataclasses.replace(model.config.rope, scaling=None)))
    plain.load_state_dict(model.state_dict())
    return plain.eval()


@pytest.mark.parametrize("arch, rope_type", [*(("Llama", t) for t in LLAMA_TYPES), ("Qwen3", "yarn")])
def test_llama_import_has_hf_logits(arch, rope_type):
    theirs = _hf_model(f"{arch}ForCausalLM", f"{arch}Config", num_key_value_heads=2,
                       rope_parameters={"rope_type": rope_type, "rope_theta": 100.0, **LLAMA_TYPES[rope_type]})
    ours = from_hf(theirs)
    assert ours.config.rope.scaling.method == rope_type
    ours.config.validate()
    for length in (12, T):  # within and beyond the original context
        _assert_same_logits(ours, theirs, length)
    _assert_scaling_matters(ours, theirs)
    back = to_hf(ours, attn_implementation="eager")  # and it exports natively again
    assert back.config.rope_parameters["rope_type"] == rope_type
    _assert_same_logits(ours, back)


def test_llama_4x_rope_scaling_fields_import():
    """A transformers 4.x LlamaConfig: flat rope_theta, the scaling in `rope_scaling` (legacy key `type`)."""
    from types import SimpleNamespace

    from ropelab.sources.hf_config_read import model_config_from_hf

    config = SimpleNamespace(model_type="llama", hidden_act="silu", num_key_value_heads=2, rms_norm_eps=1e-5,
                             initializer_range=0.02, tie_word_embeddings=False, rope_theta=100.0, **HF_COMMON,
                             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                           "beta_fast": 0})

    rope = model_config_from_hf(config).rope
    assert rope.theta == 100.0 and rope.scaling == RopeScalingConfig("yarn", 4.0, 8)  # beta 0 reads as HF's 32


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_gpt_neox_partial_rotary_import_has_hf_logits(rope_type):
    theirs = _hf_model("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_act="gelu", use_parallel_residual=True,
                       rope_parameters={"rope_type": rope_type, "rope_theta": 100.0, "partial_rotary_factor": 0.25,
                                        "factor": 4.0})
    ours = from_hf(theirs)
    assert ours.config.rope.resolve_dims(16) == 4 and ours.config.rope.scaling.method == rope_type
    _assert_same_logits(ours, theirs)
    _assert_scaling_matters(ours, theirs)
    back = to_hf(ours, attn_implementation="eager")
    assert type(back).__name__ == "GPTNeoXForCausalLM"
    _assert_same_logits(ours, back)


def _tiny(**rope) -> Transformer:
    config = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, max_seq_len=64,
                         rope=RopeConfig(theta=100.0, **rope))
    return randomize_weights(Transformer(config))


def test_static_ntk_exports_as_its_base():
    ours = _tiny(scaling=RopeScalingConfig("ntk", 4.0))
    theirs = to_hf(ours, attn_implementation="eager")
    assert theirs.config.rope_parameters["rope_type"] == "default"
    assert theirs.config.rope_parameters["rope_theta"] == pytest.approx(100.0 * 4.0 ** (16 / 14))
    _assert_same_logits(ours, theirs)
    _assert_scaling_matters(ours, theirs)


def test_dynamic_exports_with_its_original_context():
    ours = _tiny(scaling=RopeScalingConfig("dynamic", 4.0, 8))
    theirs = to_hf(ours, attn_implementation="eager")
    assert theirs.config.max_position_embeddings == 8
    _assert_same_logits(ours, theirs)


def test_without_a_native_equivalent_scaling_exports_as_remote_code():
    yarn = RopeScalingConfig("yarn", 4.0, 8)
    neox = ModelConfig(vocab_size=VOCAB, n_layer=1, d_model=64, n_head=4, d_ff=96, block="parallel", norm="layernorm",
                       mlp="gelu", attn_bias=True, mlp_bias=True, rope=RopeConfig(fraction=0.25, scaling=yarn))
    with pytest.raises(ValueError, match="rope.scaling.method=yarn: exported natively as GPTNeoXForCausalLM only for"):
        hf_architecture(neox)
    from ropelab.export.remote_code import to_remote_hf

    ours = _tiny(fraction=0.5, style="truncate", scaling=RopeScalingConfig("yarn", 4.0, 8))
    with pytest.raises(ValueError, match="rotates every channel"):
        hf_architecture(ours.config)
    _assert_same_logits(ours, to_remote_hf(ours), angles_differ=False)


# ------------------------------------------------------------------ a Llama-3 checkpoint: import, train, export


def test_llama3_round_trips_import_train_export(tmp_path, tiny_overrides):
    from ropelab.export.hf import export_hf
    from ropelab.sources import import_model, load, run_config
    from ropelab.train.loop import train

    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0,
                                                       "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0})
    torch.manual_seed(0)
    randomize_weights(transformers.LlamaForCausalLM(config)).save_pretrained(tmp_path / "hf")
    import_model(str(tmp_path / "hf"), tmp_path / "imported")
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]
    run = run_config(overrides=[*not_model, f"train.init_from={tmp_path / 'imported'}", "train.steps=2",
                                "train.eval_every=2", "train.checkpoint_every=2"])
    assert run.model.rope.scaling == RopeScalingConfig("llama3", 8.0, 16)
    train(run, tmp_path / "run")
    info = export_hf(tmp_path / "run", tmp_path / "out")
    assert info["route"] == "native" and info["architecture"] == "LlamaForCausalLM"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    trained = load(tmp_path / "run").model
    idx = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(input_ids=idx).logits
        assert_logits_match(trained(idx)[0], expected, trained.config, angles_differ=True)
        with pytest.raises(AssertionError, match="logits differ"):
            assert_logits_match(_unscaled(trained)(idx)[0], expected, trained.config, angles_differ=True)
