"""`model.position` (`ropelab.config.position`): the registry's specs, their one-line errors, and the
old spellings (`model.rope`, `model.rope_layers`, layer kinds) as one-element lists."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from ropelab.config import ConfigError, build_run_config
from ropelab.config.position import POSITION_TYPES, parse_position


def _model(*overrides: str):
    return build_run_config(overrides=list(overrides)).model


def _names(config, layer: int = 0) -> list[str]:
    return [entry.type.name for entry in config.positions_for_layer(layer)]


def test_the_old_spellings_are_one_element_lists():
    assert _names(_model()) == ["rope"]
    assert _names(_model("model.rope.fraction=0")) == ["nope"]
    layered = _model("model.rope_layers={1: {fraction: 0}}")
    assert _names(layered, 0) == ["rope"] and _names(layered, 1) == ["nope"]
    assert _model().position is None  # nothing new is written into an existing run's config


def test_the_rotation_entry_lays_its_rope_keys_over_model_rope():
    config = _model("model.position=[{type: rope, fraction: 0.25, theta: 500}, {type: alibi}]")
    assert (config.rope.fraction, config.rope.theta) == (0.25, 500.0) and _names(config) == ["rope", "alibi"]
    alone = _model("model.position=[{type: alibi}]")
    assert alone.rope.resolve_dims(alone.head_size) == 0 and _names(alone) == ["nope", "alibi"]
    fope = _model("model.position=[{type: fope, trained_length: 128, theta: 1000}]")
    assert fope.rope.theta == 1000.0 and _names(fope) == ["fope"]
    # a layer kind's `rope: none` still makes its layers NoPE; the bias stays
    hybrid = _model("model.position=[{type: fope, trained_length: 128}, {type: alibi}]", "model.layer_pattern=FN",
                    "model.layer_kinds={F: {}, N: {rope: none}}")
    assert _names(hybrid, 0) == ["fope", "alibi"] and _names(hybrid, 1) == ["nope", "alibi"]


def test_a_saved_config_reads_back_the_same():
    import dataclasses

    from ropelab.config import ModelConfig, from_dict

    config = _model("model.position=[{type: rope, fraction: 0.5}, {type: alibi, max_bias: 4}]")
    again = from_dict(ModelConfig, dataclasses.asdict(config), "model")
    assert again == config


def _refused_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _model(override)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("value, message", [
    ("3", "model.position=3: must be a list"),
    ("[]", "model.position=[]: must be a non-empty list"),
    ("[{type: xpe}]", "model.position[0].type='xpe': must be one of rope, nope, fope, alibi"),
    ("[{fraction: 0.5}]", "model.position[0].type=None: must be one of"),
    ("[{type: alibi, slope: 2}]", "model.position[0].slope: unknown key for type alibi; allowed: max_bias"),
    ("[{type: alibi, theta: 2}]", "model.position[0].theta: unknown key for type alibi"),
    ("[{type: rope}, {type: fope, trained_length: 8}]", "model.position[1]: a second rotation entry"),
    ("[{type: alibi}, {type: alibi}]", "model.position[1]: a second score_bias entry"),
    ("[{type: fope}]", "model.position[0].trained_length: required for fope"),
    ("[{type: fope, trained_length: 0}]", "model.position[0].trained_length=0: must be"),
    ("[{type: alibi, max_bias: -1}]", "model.position[0].max_bias=-1.0: must be in (0, 64]"),
    ("[{type: rope, fraction: 2}]", "model.rope.fraction=2.0: must be in [0, 1]"),
    ("[{type: fope, trained_length: 64, scaling: {method: yarn, factor: 2, original_max_position: 64}}]",
     "model.position[0]: type fope takes no model.rope.scaling"),
])
def test_bad_entries_are_one_line_errors(value, message):
    _refused_in_one_line(f"model.position={value}", message)


_ENTRY = st.sampled_from([{"type": "rope", "fraction": 0.5}, {"type": "nope"}, {"type": "fope", "trained_length": 64},
                          {"type": "alibi"}, {"type": "alibi", "max_bias": 2.0}, {"type": "rope"}])


@settings(max_examples=60, deadline=None)
@given(st.lists(_ENTRY, min_size=1, max_size=3))
def test_any_list_parses_to_one_rotation_first_or_is_refused_naming_an_entry(entries):
    try:
        parsed = parse_position(entries)
    except ConfigError as exc:
        assert str(exc).startswith("model.position[") and "\n" not in str(exc)
        channels = [POSITION_TYPES[e["type"]].channel for e in entries]
        assert len(channels) != len(set(channels))
        return
    assert parsed[0].type.channel == "rotation"
    assert [p.type.channel for p in parsed].count("rotation") == 1
    assert {p.type.name for p in parsed} >= {e["type"] for e in entries}


def test_every_registered_type_declares_its_answers():
    for name, kind in POSITION_TYPES.items():
        assert kind.name == name and kind.channel in ("rotation", "score_bias", "attention")
        assert kind.label and kind.summary and set(kind.kv_cache.tensors) <= {"keys", "values"}
        assert kind.fast_kernels <= (kind.channel == "rotation" and not kind.learned)
        assert hasattr(kind.spec(), "validate")


def test_parsing_positions_does_not_import_torch():
    code = ("import sys, ropelab.config; ropelab.config.build_run_config(overrides=["
            "'model.position=[{type: fope, trained_length: 64}, {type: alibi}]']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("override, message", [
    ("model.position=[{type: alibi, slope: 2}]", "model.position[0].slope: unknown key for type alibi"),
    ("model.position=[{type: fope}]", "model.position[0].trained_length: required for fope"),
])
def test_the_command_line_says_it_in_one_line_and_writes_nothing(tmp_path, capsys, override, message):
    from ropelab.cli import main

    assert main(["train", "--out", str(tmp_path / "r"), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ropelab: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_a_layer_kind_has_its_own_list():
    config = _model("model.layer_pattern=AR", "model.layer_kinds={A: {position: [{type: alibi}]}, R: {}}")
    assert _names(config, 0) == ["nope", "alibi"] and _names(config, 1) == ["rope"]
    assert config.rope_for_layer(0).resolve_dims(config.head_size) == 0
    # laid over model.rope, which model.position=[{type: alibi}] leaves rotating nothing: give the fraction
    fope = _model("model.position=[{type: alibi}]", "model.layer_pattern=FA",
                  "model.layer_kinds={F: {position: [{type: fope, trained_length: 64, theta: 500, fraction: 1}]}, A: {}}")
    assert _names(fope, 0) == ["fope"] and _names(fope, 1) == ["nope", "alibi"]
    assert fope.rope_for_layer(0).theta == 500.0 and fope.rope_for_layer(0).resolve_dims(fope.head_size) == 64


@pytest.mark.parametrize("kinds, message", [
    ("{A: {rope: none, position: [{type: alibi}]}}", "model.layer_kinds.A: set rope or position, not both"),
    ("{A: {position: [{type: xpe}]}}", "model.layer_kinds.A.position[0].type='xpe': must be one of"),
    ("{A: {position: [{type: fope}]}}", "model.layer_kinds.A.position[0].trained_length: required for fope"),
])
def test_a_kinds_bad_list_is_one_line_naming_the_kind(kinds, message):
    with pytest.raises(ConfigError) as raised:
        _model("model.layer_pattern=A", f"model.layer_kinds={kinds}")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


def test_a_layer_has_its_own_list_over_its_kind_and_model_position():
    config = _model("model.position=[{type: rope, fraction: 0.5}]", "model.layer_pattern=AR",
                    "model.layer_kinds={A: {position: [{type: alibi}]}, R: {}}",
                    "model.position_layers={1: [{type: fope, trained_length: 64, theta: 500}], 2: [{type: nope}]}",
                    "model.position_layers.3=[{type: rope, fraction: 1}, {type: alibi, max_bias: 4}]")
    assert [_names(config, layer) for layer in range(4)] == [["nope", "alibi"], ["fope"], ["nope"], ["rope", "alibi"]]
    dims = [config.rope_for_layer(layer).resolve_dims(config.head_size) for layer in range(4)]
    assert dims == [0, 32, 0, 64]  # layer 1's list is laid over model.rope as model.position left it (half)
    assert config.rope_for_layer(1).theta == 500.0 and config.rope_for_layer(3).theta == config.rope.theta
    assert config.positions_for_layer(3)[1].spec.max_bias == 4.0
    assert config.positions_for_layer(3)[1].key == "model.position_layers.3[1]"


@pytest.mark.parametrize("layers, message", [
    ("{4: [{type: alibi}]}", "model.position_layers.4: a layer index must be a whole number in [0, 4)"),
    ("{-1: [{type: alibi}]}", "model.position_layers.-1: a layer index must be a whole number in [0, 4)"),
    ("{1: [{type: alibi}], '1': [{type: nope}]}", "model.position_layers: layer 1 is given twice"),
    ("{1: []}", "model.position_layers.1=[]: must be a non-empty list"),
    ("{1: {type: alibi}}", "model.position_layers.1={'type': 'alibi'}: must be a non-empty list"),
    ("{1: [{type: xpe}]}", "model.position_layers.1[0].type='xpe': must be one of"),
    ("{1: [{type: fope}]}", "model.position_layers.1[0].trained_length: required for fope"),
    ("{1: [{type: alibi, max_bias: 0}]}", "model.position_layers.1[0].max_bias=0.0: must be in (0, 64]"),
    ("{1: [{type: fope, trained_length: 64, scaling: {method: linear, factor: 2}}]}",
     "model.position_layers.1[0]: type fope takes no model.rope.scaling"),
])
def test_a_layers_bad_list_is_one_line_naming_the_layer(layers, message):
    _refused_in_one_line(f"model.position_layers={layers}", message)


def test_a_layer_sets_its_rope_keys_or_its_list_not_both():
    with pytest.raises(ConfigError, match=r"^model.position_layers.1: set model.rope_layers.1 or model.position_layers.1"):
        _model("model.position_layers={1: [{type: alibi}]}", "model.rope_layers={1: {theta: 500}}")
    both = _model("model.position_layers={1: [{type: alibi}]}", "model.rope_layers={2: {theta: 500}}")
    assert _names(both, 1) == ["nope", "alibi"] and both.rope_for_layer(2).theta == 500.0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-pythia", "llama-3.2-1b"])
def test_a_config_written_before_per_layer_lists_reads_back_the_same(preset):
    import dataclasses

    from ropelab.config import ModelConfig, from_dict

    config = _model(f"model.preset={preset}", "model.rope_layers={1: {fraction: 0}}")
    written = {key: value for key, value in dataclasses.asdict(config).items() if key != "position_layers"}
    again = from_dict(ModelConfig, written, "model")
    assert again == config and again.position_layers == {}
    assert [_names(again, layer) for layer in range(again.n_layer)] == [_names(config, layer)
                                                                        for layer in range(config.n_layer)]


def test_shipped_configs_load_unchanged_and_keep_what_model_rope_alone_spells():
    from pathlib import Path

    from ropelab.config import load_yaml
    from ropelab.config.position import default_position
    from ropelab.study.grid import expand, load_study

    root = Path(__file__).parents[2] / "configs"
    models = [build_run_config(load_yaml(root / name)).model for name in ("tiny.yaml", "real/distill-smollm2.yaml",
                                                                           "real/finetune-smollm2.yaml")]
    for name in ("layouts-tiny.yaml", "position-tiny.yaml", "study-tiny-pythia.yaml"):
        models += [run.config.model for run in expand(load_study(root / name))]
    assert len(models) == 3 + 28 + 8 + 8
    for model in models:
        assert model.position_layers == {}
        if model.position is None and all(kind.position is None for kind in model.layer_kinds.values()):
            for layer in range(model.n_layer):
                dims = model.rope_for_layer(layer).resolve_dims(model.head_size)
                assert _names(model, layer) == [entry.type.name for entry in default_position(dims)]
    assert {tuple(_names(model)) for model in models} >= {("rope",), ("fope",), ("nope", "alibi"), ("nope",)}


def test_a_type_excluding_a_channel_is_refused_in_one_line_naming_both(monkeypatch):
    from ropelab.config.position import KVState, NoKeys, PositionType

    whole = PositionType("whole", "Whole", NoKeys, "attention", "a test method replacing attention",
                         excludes=("score_bias",), kv_cache=KVState(extra_per_head=3))
    monkeypatch.setitem(POSITION_TYPES, "whole", whole)
    with pytest.raises(ConfigError) as raised:
        parse_position([{"type": "alibi"}, {"type": "whole"}])
    message = str(raised.value)
    assert message == ("model.position[0] (alibi): cannot share a list with model.position[1] (whole), which "
                       "excludes score_bias"), message
    assert [p.type.name for p in parse_position([{"type": "rope"}, {"type": "whole"}])] == ["rope", "whole"]
    # a layer's own list is checked the same way
    with pytest.raises(ConfigError, match=r"^model.position_layers.2\[1\] \(alibi\): cannot share a list with "
                                          r"model.position_layers.2\[0\] \(whole\)"):
        _model("model.position_layers={2: [{type: whole}, {type: alibi}]}")


def test_what_the_kv_cache_holds_is_declared_per_type_and_combined_per_layer():
    from ropelab.config.position import KVState, layer_kv_state

    assert POSITION_TYPES["rope"].kv_cache.rotated_keys and POSITION_TYPES["fope"].kv_cache.rotated_keys
    assert not POSITION_TYPES["alibi"].kv_cache.rotated_keys and not POSITION_TYPES["nope"].kv_cache.rotated_keys
    state = layer_kv_state(parse_position([{"type": "rope"}, {"type": "alibi"}]))
    assert state == KVState(("keys", "values"), True, 0)
    assert state.numbers_per_token(kv_heads=2, head_dim=64) == 2 * 2 * 64
    assert KVState(("keys",), extra_per_head=3).numbers_per_token(2, 64) == 2 * (64 + 3)
