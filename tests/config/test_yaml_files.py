"""Every YAML ropelab reads goes through `ropelab.config.yaml_files`: a repeated key at any level, an
alias bomb, an alias inside itself and deep nesting are one line naming the file and line (issue #52)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.cli import main
from ropelab.config import ConfigError, load_yaml, parse_override, parse_yaml
from ropelab.config.yaml_files import MAX_ALIAS_NODES, MAX_DEPTH, YAMLRefused

pytestmark = pytest.mark.usefixtures("no_training")

# "billion laughs" in 396 bytes: nine levels of nine aliases each, 387 million nodes expanded
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))


def refusal(tmp_path, text: str) -> str:
    """`load_yaml`'s one-line error on a config file holding `text`."""
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(config)
    return str(err.value)


def test_a_second_train_block_is_refused_through_the_cli(tmp_path, capsys):
    """Before: the second `train:` silently replaced the first, and a 3-step config trained 200 steps."""
    config = tmp_path / "run.yaml"
    config.write_text("train: {steps: 3}\nmodel: {preset: tiny-llama}\ntrain:\n  steps: 200\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err == f"ropelab: error: {config} (line 3): key train is given twice (first at line 1); each key may appear once\n"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, key, first, line", [
    ("train:\n  steps: 3\n  lr: 0.001\n  steps: 200\n", "train.steps", 2, 4),
    ("train:\n  phases:\n    - {name: a, steps: 2}\n    - {name: b, steps: 2, name: c}\n", "train.phases[1].name", 4, 4),
    ("model: {rope_layers: {1: {fraction: 0}, 0x1: {fraction: 1}}}\n", "model.rope_layers.1", 1, 1),  # the same int
    ("seed: 0\ndata: {corpus: stdlib}\nseed: 1\n", "seed", 1, 3),
])
def test_a_repeated_key_is_refused_at_every_level(tmp_path, text, key, first, line):
    assert refusal(tmp_path, text) == (f"{tmp_path / 'run.yaml'} (line {line}): key {key} is given twice "
                                       f"(first at line {first}); each key may appear once")


@settings(max_examples=40, deadline=None)
@given(path=st.lists(st.sampled_from(["model", "train", "rope", "x1", "phases"]), min_size=1, max_size=8),
       value=st.integers())
def test_a_repeated_key_is_found_at_any_depth(path, value):
    """Property: a key given twice in the innermost mapping of any nesting is refused, naming its dotted path."""
    document = {"leaf": value}
    for key in reversed(path):
        document = {key: document}
    text = yaml.safe_dump(document, default_flow_style=True)
    repeated = text.replace("leaf: ", f"leaf: {value}, leaf: ", 1)
    assert parse_yaml(text) == document
    with pytest.raises(YAMLRefused, match=rf"key {'.'.join([*path, 'leaf'])} is given twice"):
        parse_yaml(repeated)


def test_merge_keys_may_repeat_the_mappings_own_keys():
    """`<<: *defaults` then an explicit key is YAML's way to override, not a repeated key."""
    text = "defaults: &d {lr: 0.001, steps: 3}\ntrain: {<<: *d, steps: 5}\n"
    assert parse_yaml(text)["train"] == {"lr": 0.001, "steps": 5}


def test_an_alias_bomb_is_refused_in_one_short_line(tmp_path, capsys):
    """Before: a file of a few hundred bytes printed an 800 MB error line (the expanded value quoted in full)."""
    config = tmp_path / "run.yaml"
    config.write_text(BOMB + "model: {rope: {style: *i}}\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err == (f"ropelab: error: {config} (line 6): aliases expand to more than {MAX_ALIAS_NODES:,} nodes (at *e); "
                   "write the values out instead\n")


def test_aliases_within_the_limit_still_work():
    text = "base: &b {steps: 3, lr: 0.001}\nruns: [*b, *b, *b]\n"
    assert parse_yaml(text)["runs"] == [{"steps": 3, "lr": 0.001}] * 3


def test_an_alias_inside_the_node_it_names_is_refused(tmp_path):
    assert refusal(tmp_path, "train: &t {phases: [*t]}\n") == (
        f"{tmp_path / 'run.yaml'} (line 1): alias *t is inside the node it names (a structure that contains itself)")


@pytest.mark.parametrize("opening, closing", [("[", "]"), ("{a: ", "}")])
def test_nesting_500_deep_is_one_line_not_a_recursion_error(tmp_path, capsys, opening, closing):
    config = tmp_path / "run.yaml"
    config.write_text("train: " + opening * 500 + "1" + closing * 500 + "\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"ropelab: error: {config} (line 1): nested more than {MAX_DEPTH} levels deep\n"


def test_nesting_up_to_the_limit_is_read():
    depth = MAX_DEPTH - 1
    assert parse_yaml("[" * depth + "]" * depth) is not None


def test_invalid_yaml_names_the_line_and_problem(tmp_path):
    assert refusal(tmp_path, "train:\n  steps: [3\n") == (
        f"{tmp_path / 'run.yaml'} (line 3): not valid YAML (expected ',' or ']', but got '<stream end>')")


@pytest.mark.parametrize("text, problem", [
    ("data: {corpus: 2024-13-45}\n", "'2024-13-45' is not a valid timestamp"),  # YAML reads it as a date
    ("train:\n  steps: !!int x\n", "'x' is not a valid int"),
    ("seed: !!timestamp x\n", "'x' is not a valid timestamp"),
])
def test_a_value_its_tag_cannot_make_is_one_line(tmp_path, text, problem):
    """Before: the conversion's ValueError or AttributeError came out as a traceback."""
    assert refusal(tmp_path, text) == f"{tmp_path / 'run.yaml'} (line {text.count(chr(10))}): not valid YAML ({problem})"


def test_an_override_is_read_by_the_same_rules():
    with pytest.raises(ConfigError, match=r"^model.rope_layers: key 1 is given twice"):
        parse_override("model.rope_layers={1: {fraction: 0}, 1: {fraction: 1}}")
    assert parse_override("data.corpus=a: b: c") == ("data.corpus", "a: b: c")  # not YAML: the text as it is
