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


@pytest.mark.parametrize("jobs", ["-1", "0", "two"])
@pytest.mark.parametrize("command", ["study", "claims"])
def test_jobs_below_one_is_refused(command, jobs, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--jobs", jobs, "--dry-run"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ropelab {command}: error: argument --jobs: '{jobs}': expected a whole number >= 1")


WRITERS = [  # every command that writes, as far as its --out check (inputs named here need not exist)
    ["train"], ["distill", "distill.teacher=nowhere"], ["distill", "--cache", "distill.teacher=nowhere"],
    ["study"], ["claims"], ["memory", "--presets", "llama-3.2-1b"], ["report", "STUDY"], ["fit", "STUDY"],
    ["export", "nowhere"], ["import", "nowhere"], ["convert", "nowhere"], ["eval", "lm", "nowhere"],
    ["eval", "longctx", "nowhere"], ["eval", "extrapolation", "nowhere"], ["probe", "run", "nowhere"],
    ["probe", "weights", "a", "b"], ["data", "prepare", "--source", "stdlib", "--tokenizer", "bytes"],
]


@pytest.mark.parametrize("out_kind", ["foreign folder", "file", "through a file", "empty"])
@pytest.mark.parametrize("argv", WRITERS, ids=lambda argv: " ".join(argv[:2]))
def test_writers_refuse_an_out_that_is_not_theirs(tmp_path, capsys, argv, out_kind):
    """One line, exit 2, and nothing changed, for a folder holding someone else's file, a file, a path
    through a file, and empty text."""
    (tmp_path / "STUDY" / "runs").mkdir(parents=True)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    out = {"foreign folder": str(theirs), "file": str(tmp_path / "file"), "through a file": str(tmp_path / "file" / "x"),
           "empty": ""}[out_kind]
    argv = [str(tmp_path / a) if a == "STUDY" else a for a in argv]
    assert main([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ropelab: error: ") and err.count("\n") == 1, err
    assert (f"--out {out!r}: empty" if out_kind == "empty" else out) in err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"] and (tmp_path / "file").read_text() == "mine"


def test_study_run_ids_stay_inside_the_study(tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text("variants: [{name: ../escaped, train.steps: 1}]\n")
    assert main(["study", "--config", str(config), "--out", str(tmp_path / "study")]) == 2
    assert "variants[0]: run id='../escaped': names a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


@pytest.mark.parametrize("theta", ["-1", "0"])
def test_rope_base_refuses_a_base_that_is_not_positive(theta, capsys):
    assert main(["rope-base", "--context", "16", "--dims", "8", f"--theta={theta}", "--json"]) == 2
    assert capsys.readouterr().err == f"ropelab: error: theta={float(theta)}: must be a finite number > 0 (a RoPE base)\n"


@pytest.mark.parametrize("theta", ["nan", "inf", "1e400"])
def test_rope_base_refuses_a_base_that_is_not_finite(theta, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rope-base", "--context", "16", "--dims", "8", f"--theta={theta}"])
    assert exit_.value.code == 2 and "expected comma-separated finite numbers" in capsys.readouterr().err
