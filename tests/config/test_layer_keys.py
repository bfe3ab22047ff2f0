"""The keys that name layers: layer kinds (`model.layer_kinds`, and phase overrides of a kind) and layer
indices (`model.rope_layers`). A wrong one is one line naming the key and what is allowed, never a
traceback, and never silently ignored (issue #52)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.cli import main
from ropelab.config import ConfigError, build_run_config

pytestmark = pytest.mark.usefixtures("no_training")

def refused(tmp_path, capsys, text: str) -> str:
    """`ropelab train --config` on a config holding `text`: exit 2, one line on stderr, nothing written."""
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ropelab: error: "), err
    assert not (tmp_path / "r").exists()
    return err.removeprefix("ropelab: error: ").strip()


def test_a_phase_override_of_a_kind_the_pattern_lacks_is_refused(tmp_path, capsys):
    """Before: `g` (for `G`) made a new kind no layer has, and the phase changed nothing."""
    text = ("model:\n  layer_pattern: LLLG\n  layer_kinds:\n    L: {attention: sliding, window: 64}\n    G: {rope: none}\n"
            "train:\n  phases:\n    - {name: a, steps: 2}\n"
            "    - {name: b, steps: 2, overrides: {model.layer_kinds.g.rope.theta: 100000}}\n")
    assert refused(tmp_path, capsys, text) == (
        "train.phases[1].overrides.model.layer_kinds.g.rope.theta: layer kind 'g' is not in model.layer_pattern "
        "(its kinds are G, L; kinds are case-sensitive)")


def test_a_phase_override_of_a_layer_kind_needs_a_pattern():
    with pytest.raises(ConfigError, match=r"layer kind 'G' is not in model.layer_pattern \(none is set\)$"):
        build_run_config({"train": {"phases": [{"name": "a", "steps": 2, "overrides": {
            "model.layer_kinds.G.rope.theta": 1e5}}]}})


def test_a_phase_override_of_a_kind_in_the_pattern_is_kept():
    layout = {"layer_pattern": "LLLG", "layer_kinds": {"L": {"rope": {"theta": 1e4}}, "G": {"rope": {"theta": 1e6}}}}
    config = build_run_config({"model": layout, "train": {"phases": [{"name": "a", "steps": 2, "overrides": {
        "model.layer_kinds.G.rope.theta": 5e6}}]}})
    assert config.train.phases[0].overrides == {"model.layer_kinds.G.rope.theta": 5e6}


@pytest.mark.parametrize("kinds", ["{1: {rope: none}}", "{L: {}, 1: {rope: none}}", "{null: {}}", "{1.5: {}}"])
def test_a_layer_kind_named_by_a_number_is_refused(tmp_path, capsys, kinds):
    """Before: `{1: {...}}` with pattern "11" ended in a TypeError traceback (sorted and joined its names)."""
    text = f"model:\n  layer_pattern: '11'\n  layer_kinds: {kinds}\n"
    message = refused(tmp_path, capsys, text)
    assert message.startswith("model.layer_kinds.") and message.endswith(
        ": a layer kind is named by one character, a string (in YAML, quote a digit: '1')")


@pytest.mark.parametrize("rope_layers, message", [
    ("{a: {fraction: 0}}", "model.rope_layers.'a': a layer index must be a whole number in [0, 4)"),
    ("{1.5: {fraction: 0}}", "model.rope_layers.1.5: a layer index must be a whole number in [0, 4)"),
    ("{true: {fraction: 0}}", "model.rope_layers.True: a layer index must be a whole number in [0, 4)"),
    ("{'01': {fraction: 0}}", "model.rope_layers.'01': a layer index must be a whole number in [0, 4)"),
    ("{7: {fraction: 0}}", "model.rope_layers.7: a layer index must be a whole number in [0, 4)"),
    ("{1: {fraction: 0}, '1': {fraction: 0.5}}", "model.rope_layers: layer 1 is given twice (as 1 and '1')"),
    ("{1: 5}", "model.rope_layers.1=5: must be a mapping of model.rope keys, e.g. {fraction: 0}"),
    ("{1: [1]}", "model.rope_layers.1=[1]: must be a mapping of model.rope keys, e.g. {fraction: 0}"),
    ("{1: none}", "model.rope_layers.1='none': must be a mapping of model.rope keys, e.g. {fraction: 0}"),
    ("'0'", "model.rope_layers='0': must be a mapping"),
    ("[0.5, 1.5]", "model.rope_layers=[0.5, 1.5]: must be a mapping"),
    ("[true, false]", "model.rope_layers=[True, False]: must be a mapping"),
    ("[[1, 2]]", "model.rope_layers=[[1, 2]]: must be a mapping"),
])
def test_rope_layers_of_a_wrong_type_are_one_line(tmp_path, capsys, rope_layers, message):
    """Before: a string key, an int(...) ValueError; a number for the keys, a TypeError; 1.5 and true
    silently applied to no layer or layer 1."""
    assert refused(tmp_path, capsys, f"model:\n  rope_layers: {rope_layers}\n").startswith(message)


def test_rope_layers_keys_from_yaml_and_dotted_overrides_both_name_layers():
    config = build_run_config({"model": {"rope_layers": {3: {"fraction": 0}}}}, overrides=["model.rope_layers.1.fraction=0"])
    assert [config.model.rope_for_layer(i).resolve_dims(config.model.head_size) for i in range(4)] == [64, 0, 64, 0]


@settings(max_examples=60, deadline=None)
@given(key=st.one_of(st.integers(-3, 8), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4),
                     st.none()),
       override=st.one_of(st.none(), st.just({"fraction": 0.0}), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2)))
def test_any_rope_layers_entry_is_a_config_or_a_one_line_error(key, override):
    """Property: whatever a `model.rope_layers` entry holds, the config either builds and the entry applies to
    exactly the layer it names, or is refused with a ConfigError naming model.rope_layers."""
    try:
        config = build_run_config({"model": {"rope_layers": {key: override}}})
    except ConfigError as exc:
        assert str(exc).startswith("model.rope_layers") and "\n" not in str(exc)
        return
    layer = int(key)
    assert isinstance(key, int) and not isinstance(key, bool) or str(layer) == key
    assert 0 <= layer < 4 and (override is None or isinstance(override, dict))
    assert config.model.rope_for_layer(layer).resolve_dims(config.model.head_size) == (0 if override else 64)
