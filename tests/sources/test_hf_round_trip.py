"""The round trip that gates a native export (`ropelab.sources.hf_round_trip`): every model that exports
natively reads back as itself, and without the deny-list the round trip alone still refuses every model
the deny-list names, and any setting it has never heard of."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from ropelab.config import MODEL_PRESETS, LayerKind, ModelConfig, QueryTemperature, RopeConfig  # noqa: E402
from ropelab.config.rope import RopeScalingConfig  # noqa: E402
from ropelab.export.hf import save_hf  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from ropelab.sources import hf_config_write  # noqa: E402
from ropelab.sources.hf_round_trip import native_architecture, round_trip_changes  # noqa: E402

TINY = dict(vocab_size=128, n_layer=2, d_model=64, n_head=4, d_ff=96, max_seq_len=256)
LLAMA = ModelConfig(name="llama", n_kv_head=2, rope=RopeConfig(theta=500.0), **TINY)
NEOX = ModelConfig(name="neox", block="parallel", norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True,
                   rope=RopeConfig(fraction=0.25), **TINY)
YARN = RopeScalingConfig(method="yarn", factor=4.0, original_max_position=64)

NATIVE = {
    "llama": LLAMA,
    "neox": NEOX,
    "qwen3": dataclasses.replace(LLAMA, qk_norm=True),
    "llama-yarn": dataclasses.replace(LLAMA, rope=RopeConfig(theta=500.0, scaling=YARN)),
    "llama-ntk": dataclasses.replace(LLAMA, rope=RopeConfig(scaling=RopeScalingConfig(method="ntk", factor=2.0))),
    "llama-dynamic": dataclasses.replace(LLAMA, rope=RopeConfig(
        scaling=RopeScalingConfig(method="dynamic", factor=2.0, original_max_position=64))),
    "llama-truncate-full": dataclasses.replace(LLAMA, rope=RopeConfig(style="truncate", cache="none")),
    "neox-linear": dataclasses.replace(NEOX, rope=RopeConfig(
        fraction=0.25, scaling=RopeScalingConfig(method="linear", factor=2.0))),
    **{name: dataclasses.replace(MODEL_PRESETS[name], vocab_size=256)
       for name in ("tiny-llama", "tiny-pythia", "tiny-smollm3", "tiny-command-a") if name in MODEL_PRESETS},
}

# models the deny-list refuses, each with what changes when its HF config is read back
DENIED = {
    "interleaved": (dataclasses.replace(LLAMA, rope=RopeConfig(layout="interleaved")), "rope.layout"),
    "partial-llama": (dataclasses.replace(LLAMA, rope=RopeConfig(fraction=0.5)), "rope.rotary_dims"),
    "layers-differ": (dataclasses.replace(LLAMA, rope_layers={1: {"theta": 5.0}}), "rope.theta"),
    "neox-truncate": (dataclasses.replace(NEOX, rope=RopeConfig(fraction=0.25, style="truncate")), "rope.style"),
    "chunked": (dataclasses.replace(LLAMA, layer_pattern="C", layer_kinds={
        "C": LayerKind(attention="chunked", window=16)}), "kind.attention"),
    "temperature": (dataclasses.replace(LLAMA, layer_pattern="RN", layer_kinds={
        "R": LayerKind(), "N": LayerKind(rope="none", temperature=QueryTemperature())}), "kind.temperature"),
    "two-windows": (dataclasses.replace(LLAMA, layer_pattern="AB", layer_kinds={
        "A": LayerKind(attention="sliding", window=8), "B": LayerKind(attention="sliding", window=16)}),
        "kind.window"),
    "qwen3-nope": (dataclasses.replace(LLAMA, qk_norm=True, rope_layers={1: {"fraction": 0}}), "rope.rotary_dims"),
}


@pytest.mark.parametrize("name", NATIVE)
def test_native_models_read_back_as_themselves(name):
    assert round_trip_changes(NATIVE[name]) == []
    native_architecture(NATIVE[name])


@pytest.mark.parametrize("name", DENIED)
def test_the_round_trip_alone_refuses_what_the_deny_list_names(name, monkeypatch):
    config, setting = DENIED[name]
    with pytest.raises(ValueError):
        native_architecture(config)  # the deny-list's reason
    monkeypatch.setattr(hf_config_write, "_rope_obstacles", lambda *args: [])
    monkeypatch.setattr(hf_config_write, "_layout_obstacles", lambda *args: [])
    with pytest.raises(ValueError, match=f"reads back as another model.*{setting}"):
        native_architecture(config)


@dataclasses.dataclass
class _ScaledLogits(ModelConfig):
    """A model setting the deny-list has never heard of (as any field added to ModelConfig later)."""

    logit_scale: float = 2.0


@dataclasses.dataclass
class _BiasedKind(LayerKind):
    score_bias: str = "alibi"


@pytest.mark.parametrize("config", [
    _ScaledLogits(**{f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(ModelConfig)}),
    dataclasses.replace(LLAMA, layer_pattern="B", layer_kinds={"B": _BiasedKind()}),
], ids=["model-field", "layer-kind-field"])
def test_a_setting_unknown_to_the_deny_list_is_not_exported_natively(config):
    changes = round_trip_changes(config)
    assert len(changes) == 1 and ("logit_scale: 2.0 -> 'absent'" in changes[0] or "score_bias" in changes[0])
    with pytest.raises(ValueError, match="reads back as another model"):
        native_architecture(config)


def test_export_ships_remote_code_when_only_the_round_trip_objects(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_config_write, "_rope_obstacles", lambda *args: [])
    info = save_hf(Transformer(DENIED["interleaved"][0]), tmp_path / "hf")
    assert info["route"] == "remote_code" and "rope.layout: 'interleaved' -> 'half'" in info["why"]
    assert save_hf(Transformer(LLAMA), tmp_path / "native")["route"] == "native"
