import json

import pytest

from ropelab.cli import COMMANDS, main


def test_presets_json_lists_every_preset_with_counts(capsys):
    assert main(["presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["pythia-1b"]["params"] == 1_011_781_632 and rows["pythia-1b"]["rotary_dims"] == 64
    assert rows["llama-3.2-1b"]["params"] == 1_235_814_400


@pytest.mark.parametrize("command", [c[0] for c in COMMANDS])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: ropelab" in capsys.readouterr().out


def test_train_help_documents_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "model.rope.fraction" in out and "2*floor(fraction*head_dim/2)" in out


def test_memory_command_writes_table_and_plot(tmp_path, capsys):
    assert main(["memory", "--presets", "llama-3.2-1b", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "memory.png").stat().st_size > 0 and "10000000" in (tmp_path / "memory.csv").read_text()
    assert "RoPE cache bytes" in capsys.readouterr().out


def test_memory_unknown_preset(capsys):
    assert main(["memory", "--presets", "nope-9b"]) == 2
    assert "nope-9b" in capsys.readouterr().err


def test_command_options_from_config_file(tmp_path):
    """`--config` of eval longctx and probe run: YAML keys are the options' names, the command line wins,
    an unknown key or a missing positional list is one line."""
    import argparse

    from ropelab.cli.common import options_with_config
    from ropelab.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("runs: [a, b]\nlengths: [512, 1024]\nseed: 3\n")
    args = argparse.Namespace(config=str(path), runs=[], lengths=None, seed=7)
    assert options_with_config(args, ("lengths", "seed"), "runs") == {"runs": ["a", "b"], "lengths": [512, 1024], "seed": 7}
    args = argparse.Namespace(config=str(path), runs=["c"], lengths=None, seed=None)
    assert options_with_config(args, ("lengths", "seed"), "runs")["runs"] == ["c"]
    path.write_text("runs: a\nlenghts: [1]\n")
    with pytest.raises(ConfigError, match="unknown key 'lenghts'; allowed: lengths, runs, seed"):
        options_with_config(args, ("lengths", "seed"), "runs")
    with pytest.raises(ConfigError, match="runs: give one or more"):
        options_with_config(argparse.Namespace(config=None, runs=[], lengths=None, seed=None), ("lengths", "seed"), "runs")
