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
    with pytest.raises(ConfigError) as raised:
        _model(f"model.position={value}")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


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
        assert kind.label and kind.summary and kind.kv_cache
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
