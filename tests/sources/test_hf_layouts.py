"""Hybrid layouts through Hugging Face: SmolLM3's NoPE layers and sliding windows, Qwen2/Qwen3's
sliding-window layers. Configs read into layer kinds and written back unchanged; tiny random models
saved by transformers, loaded by ropelab with HF's logits (fp32, within what rounding explains:
tests/helpers.py's parity_tolerance, beyond the window too), exported back natively with the same
logits; ropelab layouts exported as SmolLM3 or Qwen3 where those hold them, else as ropelab's own
code; the hybrid releases ropelab does not convert refused in one line naming what it lacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelab.config import ConfigError, LayerKind, ModelConfig, RopeScalingConfig  # noqa: E402
from ropelab.export.hf import save_hf  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from ropelab.sources import load, load_config  # noqa: E402
from ropelab.sources.hf_config_read import model_config_from_hf  # noqa: E402
from ropelab.sources.hf_config_write import hf_architecture, hf_config_for  # noqa: E402
from tests.helpers import assert_logits_match, randomize_weights  # noqa: E402

VOCAB, T, WINDOW = 320, 32, 8  # 32 tokens: four windows of 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
SLIDING = dict(use_sliding_window=True, sliding_window=WINDOW)
MIXED = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def smollm3(**kwargs):
    no_ids = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # its defaults lie beyond VOCAB
    return transformers.SmolLM3Config(**SHAPE | dict(num_hidden_layers=4) | no_ids | ROPE | kwargs)


def qwen3(**kwargs):
    return transformers.Qwen3Config(**SHAPE | dict(num_hidden_layers=4, head_dim=16) | ROPE | kwargs)


# ------------------------------------------------------------------ reading configs


def test_smollm3_nope_layers_read_as_a_pattern():
    config = model_config_from_hf(smollm3(num_hidden_layers=8))  # HF's default: every fourth layer NoPE
    assert config.layer_pattern == "RRRN"
    assert config.layer_kinds == {"R": LayerKind(), "N": LayerKind(rope="none")}
    assert [config.rope_for_layer(i).resolve_dims(16) for i in range(8)] == [16, 16, 16, 0] * 2
    assert model_config_from_hf(smollm3(no_rope_layer_interval=2)).layer_pattern == "RN"
    assert model_config_from_hf(smollm3(no_rope_layers=[1, 0, 0, 1])).layer_pattern == "RNNR"  # no period: every layer
    assert model_config_from_hf(smollm3(no_rope_layers=[1] * 4)).layer_pattern is None  # a plain Llama


def test_smollm3_sliding_window_reads_into_the_nope_kind():
    """SmolLM3's own rule with use_sliding_window: its NoPE layers see a window."""
    config = model_config_from_hf(smollm3(**SLIDING))
    assert config.layer_pattern == "RRRW"
    assert config.layer_kinds["W"] == LayerKind(rope="none", attention="sliding", window=WINDOW)


def test_qwen_sliding_layers_read_as_kinds():
    config = model_config_from_hf(qwen3(**SLIDING, max_window_layers=2))  # HF: layers from the second on slide
    assert config.layer_pattern == "RRSS" and config.layer_kinds["S"] == LayerKind(attention="sliding", window=WINDOW)
    config = model_config_from_hf(qwen3(**SLIDING, layer_types=["sliding_attention", "full_attention"] * 2))
    assert config.layer_pattern == "SR"
    qwen2 = transformers.Qwen2Config(**SHAPE | dict(num_hidden_layers=2) | ROPE | SLIDING, max_window_layers=0)
    assert model_config_from_hf(qwen2).layer_pattern == "S"


def test_sliding_layers_need_a_window_and_a_class_that_has_them():
    with pytest.raises(ConfigError, match="sliding_window=None"):  # Qwen3 drops the window without the flag
        model_config_from_hf(qwen3(sliding_window=WINDOW, layer_types=MIXED))
    llama = transformers.LlamaConfig(**SHAPE | dict(num_hidden_layers=4) | ROPE, layer_types=MIXED, sliding_window=8)
    with pytest.raises(ConfigError, match="LlamaForCausalLM attends to every earlier token"):
        model_config_from_hf(llama)


def test_rope_parameters_nested_by_layer_type():
    same = {"rope_type": "default", "rope_theta": 500.0}
    config = qwen3(**SLIDING, layer_types=MIXED)
    config.rope_parameters = {"full_attention": dict(same), "sliding_attention": dict(same)}
    assert model_config_from_hf(config).rope.theta == 500.0
    config.rope_parameters["sliding_attention"]["rope_theta"] = 10_000.0
    with pytest.raises(ConfigError, match="differ between layer types .*Qwen3ForCausalLM applies one RoPE"):
        model_config_from_hf(config)
    partial = dict(same, partial_rotary_factor=0.5)  # Qwen3 rotates whole heads: refused, not ignored
    config.rope_parameters = {"full_attention": dict(partial), "sliding_attention": dict(partial)}
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5, but the class rotates every channel"):
        model_config_from_hf(config)


def test_nested_rope_parameters_round_trip():
    """transformers 5 writes rope_parameters per layer type; equal ones read as one setting and write back."""
    config = qwen3(**SLIDING, layer_types=MIXED)
    config.rope_parameters = {kind: dict(YARN) for kind in ("full_attention", "sliding_attention")}
    ours = model_config_from_hf(config)
    assert ours.rope.theta == 500.0 and ours.rope.scaling == RopeScalingConfig("yarn", 4.0, 64)
    assert model_config_from_hf(hf_config_for(dataclasses.replace(ours))) == ours


YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "original_max_position_embeddings": 64,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROUND_TRIPS = {
    "smollm3-nope": smollm3(num_hidden_layers=8),
    "smollm3-nope-yarn": smollm3(rope_parameters=dict(YARN)),
    "smollm3-nope-sliding": smollm3(**SLIDING),
    "smollm3-sliding-any-layers": smollm3(**SLIDING, layer_types=MIXED, attention_bias=True),
    "qwen3-sliding-llama3": qwen3(**SLIDING, layer_types=MIXED, rope_parameters=dict(LLAMA3)),
    "qwen3-tail-sliding": qwen3(**SLIDING, max_window_layers=3),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_read_write_read_is_the_same_config(case):
    config = model_config_from_hf(ROUND_TRIPS[case])
    config.validate()
    written = hf_config_for(dataclasses.replace(config))
    assert written.model_type == ROUND_TRIPS[case].model_type
    assert model_config_from_hf(written) == config
    assert written.rope_parameters["rope_type"] == ROUND_TRIPS[case].rope_parameters["rope_type"]


def test_scaling_beside_nope_layers_rides_on_the_rope_kinds():
    config = model_config_from_hf(smollm3(rope_parameters=dict(YARN)))
    assert config.rope.scaling is None and config.rope_for_layer(3).resolve_dims(16) == 0
    assert config.rope_for_layer(0).scaling == RopeScalingConfig("yarn", 4.0, 64)


# ------------------------------------------------------------------ writing configs


def _preset(name: str) -> ModelConfig:
    return ModelConfig.from_name(name, vocab_size=VOCAB)


def test_layouts_with_a_native_class():
    assert hf_architecture(_preset("tiny-smollm3")) == "smollm3"
    assert hf_architecture(_preset("tiny-command-a")) == "smollm3"  # sliding RoPE layers, full NoPE layers
    written = hf_config_for(_preset("tiny-command-a"))
    assert written.no_rope_layers == [1, 1, 1, 0] and written.layer_types == ["sliding_attention"] * 3 + [
        "full_attention"] and written.sliding_window == 128 and written.use_sliding_window
    plain = ModelConfig.from_name("tiny-llama", vocab_size=VOCAB)
    assert hf_architecture(plain) == "llama"
    all_nope = dataclasses.replace(plain, rope=dataclasses.replace(plain.rope, fraction=0.0))
    with pytest.raises(ValueError, match="rotates every channel"):  # no RoPE layer at all: not a SmolLM3
        hf_architecture(all_nope)


@pytest.mark.parametrize("name, reasons", [
    ("tiny-llama4-irope", ["chunked attention", "temperature"]),
    ("tiny-gemma3", ["different RoPE settings"]),
    ("tiny-gemma4", ["different RoPE settings"]),
])
def test_layouts_without_a_native_class(name, reasons):
    with pytest.raises(ValueError) as err:
        hf_architecture(_preset(name))
    assert all(reason in str(err.value) for reason in reasons), str(err.value)


def test_qwen3_refuses_nope_layers_and_two_windows():
    config = dataclasses.replace(_preset("tiny-smollm3"), qk_norm=True)
    with pytest.raises(ValueError, match=r"NoPE layers \[3\] among RoPE layers: Qwen3ForCausalLM"):
        hf_architecture(config)
    kinds = {"A": LayerKind(attention="sliding", window=8), "B": LayerKind(attention="sliding", window=16)}
    config = dataclasses.replace(config, layer_pattern="AB", layer_kinds=kinds)
    with pytest.raises(ValueError, match=r"sliding windows of \[8, 16\] tokens: Qwen3ForCausalLM has one"):
        hf_architecture(config)


def test_smollm3_has_no_head_dim_of_its_own():
    config = dataclasses.replace(_preset("tiny-smollm3"), head_dim=32)
    with pytest.raises(ValueError, match="SmolLM3ForCausalLM needs head_dim = d_model / n_head"):
        hf_architecture(config)


# ------------------------------------------------------------------ refusals


def _gemma(cls_name: str, **kw):
    return getattr(transformers, cls_name)(**SHAPE | dict(num_hidden_layers=2, head_dim=16) | kw)


REFUSALS = {
    "gemma2": (lambda: _gemma("Gemma2Config"), "soft-capped"),
    "gemma3": (lambda: _gemma("Gemma3TextConfig"), "extra norms"),
    "gemma4": (lambda: _gemma("Gemma4TextConfig"), "larger head_dim on its global layers"),
    "cohere2": (lambda: transformers.Cohere2Config(**SHAPE | dict(num_hidden_layers=4)), "logit_scale"),
    "llama4": (lambda: transformers.Llama4TextConfig(**SHAPE | dict(num_hidden_layers=4, head_dim=16)),
               "mixture-of-experts"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_hybrid_releases_are_refused_in_one_line(case, tmp_path):
    make, piece = REFUSALS[case]
    with pytest.raises(ConfigError, match=piece):
        model_config_from_hf(make())
    make().save_pretrained(tmp_path)  # the config alone: what `ropelab import` and `load_config` read first
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path))
    assert piece in str(err.value) and "\n" not in str(err.value) and "not convertible" in str(err.value)


# ------------------------------------------------------------------ models: HF -> ropelab -> HF


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out[0] if isinstance(out, tuple) else out.logits


def _hf_pretrained(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=False, dtype=torch.float32, attn_implementation="eager").eval()


MODELS = {
    "smollm3-nope": ("SmolLM3ForCausalLM", lambda: smollm3(num_hidden_layers=4)),
    "smollm3-nope-sliding": ("SmolLM3ForCausalLM", lambda: smollm3(**SLIDING)),
    "qwen3-sliding": ("Qwen3ForCausalLM", lambda: qwen3(**SLIDING, layer_types=MIXED)),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_hf_folder_loads_with_hf_logits_and_exports_back(case, tmp_path):
    class_name, make = MODELS[case]
    torch.manual_seed(0)
    theirs = randomize_weights(getattr(transformers, class_name)._from_config(
        make(), dtype=torch.float32, attn_implementation="eager"))
    theirs.save_pretrained(tmp_path / "hf")
    ours = load(str(tmp_path / "hf")).model
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    expected = _logits(theirs, ids)
    assert_logits_match(_logits(ours, ids), expected, ours.config, angles_differ=True)
    # the layout matters beyond the first window: with every layer a RoPE layer over the whole context,
    # the logits there differ (so the comparison above can fail)
    plain_kinds = dict.fromkeys(ours.config.layer_kinds, LayerKind())
    plain = Transformer(dataclasses.replace(ours.config, layer_kinds=plain_kinds))
    plain.load_state_dict(ours.state_dict())
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_match(_logits(plain.eval(), ids)[:, WINDOW:], expected[:, WINDOW:], ours.config,
                            angles_differ=True)
    assert save_hf(ours, tmp_path / "back")["route"] == "native"
    back = _hf_pretrained(tmp_path / "back")
    assert type(back).__name__ == class_name
    assert_logits_match(_logits(back, ids), expected, ours.config)


def _windowed(name: str) -> ModelConfig:
    """A tiny preset at VOCAB tokens, its windows cut to WINDOW."""
    config = _preset(name)
    kinds = {k: dataclasses.replace(v, window=WINDOW) if v.window else v for k, v in config.layer_kinds.items()}
    return dataclasses.replace(config, layer_kinds=kinds)


ROPELAB_LAYOUTS = {
    "tiny-command-a": (lambda: _windowed("tiny-command-a"), "SmolLM3ForCausalLM"),
    "rope-layers-nope": (lambda: ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, d_ff=96,
                                             rope_layers={1: {"fraction": 0.0}}), "SmolLM3ForCausalLM"),
    "qwen3-sliding": (lambda: dataclasses.replace(_windowed("tiny-gemma3"), qk_norm=True, layer_kinds={
        "L": LayerKind(attention="sliding", window=WINDOW), "G": LayerKind()}), "Qwen3ForCausalLM"),
}


@pytest.mark.parametrize("case", list(ROPELAB_LAYOUTS))
def test_ropelab_layout_exports_natively_with_its_logits(case, tmp_path):
    make, class_name = ROPELAB_LAYOUTS[case]
    torch.manual_seed(0)
    ours = randomize_weights(Transformer(make()))
    info = save_hf(ours, tmp_path / "hf")
    assert (info["route"], info["architecture"]) == ("native", class_name)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    assert_logits_match(_logits(_hf_pretrained(tmp_path / "hf"), ids), _logits(ours, ids), ours.config,
                        angles_differ=True)


def test_layout_without_a_native_class_exports_as_ropelab_code(tmp_path):
    """Llama 4's chunks and query temperature: ropelab's own modeling code in the folder (`remote_code`)."""
    config = _windowed("tiny-llama4-irope")
    kinds = dict(config.layer_kinds, G=dataclasses.replace(config.layer_kinds["G"], temperature=dataclasses.replace(
        config.layer_kinds["G"].temperature, floor_scale=float(WINDOW))))
    torch.manual_seed(0)
    ours = randomize_weights(Transformer(dataclasses.replace(config, layer_kinds=kinds)))
    info = save_hf(ours, tmp_path / "hf")
    assert info["route"] == "remote_code" and "chunked attention" in info["why"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    assert_logits_match(_logits(theirs, ids), _logits(ours, ids), ours.config)
