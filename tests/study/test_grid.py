from pathlib import Path

import pytest

from ropelab.cli import main
from ropelab.config import ConfigError
from ropelab.study.grid import StudyConfig, default_study, expand, load_study

# every run and study config; configs/eval holds lm-eval task definitions, not ropelab configs
CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "configs").rglob("*.yaml") if p.parent.name != "eval")


def test_default_study_is_the_seed_fraction_grid():
    runs = expand(default_study())
    dims = [r.config.model.rope.resolve_dims(r.config.model.head_size) for r in runs]
    assert [r.id for r in runs] == ["nope", "2ch", "rope10", "rope25", "rope50", "rope75", "rope100"]
    assert dims == [0, 2, 6, 16, 32, 48, 64]
    assert {r.config.model.name for r in runs} == {"tiny-llama"}


def test_grid_is_a_cartesian_product_with_readable_ids():
    study = StudyConfig(base={"preset": "tiny-pythia"}, variants=[{"name": "a", "model.rope.fraction": 0.5}],
                        grid={"seed": [0, 1], "train.lr": [1e-3, 4e-4]})
    runs = expand(study)
    assert [r.id for r in runs] == ["a-seed0-lr0.001", "a-seed0-lr0.0004", "a-seed1-lr0.001", "a-seed1-lr0.0004"]
    assert runs[3].config.seed == 1 and runs[3].config.train.lr == 4e-4 and runs[3].config.model.block == "parallel"


def test_keys_joined_by_commas_move_together():
    study = StudyConfig(base={"preset": "tiny-llama", "model": {"head_dim": 64, "n_head": 1, "n_kv_head": 1}},
                        grid={"model.d_model,model.d_ff": [[32, 64], [64, 192]], "model.n_layer": [1, 2]})
    runs = expand(study)
    assert [r.id for r in runs] == ["d_model32-d_ff64-n_layer1", "d_model32-d_ff64-n_layer2",
                                    "d_model64-d_ff192-n_layer1", "d_model64-d_ff192-n_layer2"]
    shapes = [(r.config.model.d_model, r.config.model.d_ff, r.config.model.n_layer, r.config.model.head_size) for r in runs]
    assert shapes == [(32, 64, 1, 64), (32, 64, 2, 64), (64, 192, 1, 64), (64, 192, 2, 64)]
    assert runs[1].overrides == {"model.d_model": 32, "model.d_ff": 64, "model.n_layer": 2}


@pytest.mark.parametrize("study, message", [
    (StudyConfig(), "empty grid"),
    (StudyConfig(grid={"model.d_model,model.d_ff": [[32, 64], [64]]}), r"grid\.model\.d_model,model\.d_ff: each value must be a list of 2"),
    (StudyConfig(grid={"model.d_model,model.d_ff": [64]}), "one per key"),
    (StudyConfig(grid={"model.rope.fractoin": [0.5]}), "model.rope.fractoin"),
    (StudyConfig(grid={"seed": []}), "grid.seed"),
    (StudyConfig(grid={"model.rope.fraction": [0.5, 2.0]}), "fraction2"),
])
def test_bad_grids_are_refused(study, message):
    with pytest.raises(ConfigError, match=message):
        expand(study)


def test_unknown_study_key(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\ngird: {seed: [1]}\n")
    with pytest.raises(ConfigError, match="gird"):
        load_study(path)


def test_a_300_character_variant_name_is_one_line(tmp_path, capsys):
    """Before: the dry run passed, and the real run stopped in an OSError traceback (file name too long)."""
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nbase: {{preset: tiny-llama}}\nvariants: [{{name: {'v' * 300}}}]\n")
    assert main(["study", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ropelab: error: variants[0]: run id='vvv")
    assert err.endswith("names a folder, so it may be at most 100 characters long, not 300\n")


@pytest.mark.parametrize("line, message", [
    ("base: 5", "base=5: must be a mapping"),
    ("base: [1]", "base=[1]: must be a mapping"),
    ("name: [1]", "name=[1]: must be a string"),
    ("target_loss: x", "target_loss='x': must be a number"),
    ("teacher_cache: x", "teacher_cache='x': must be true or false"),
    ("longctx: 5", "longctx=5: must be a mapping"),
    ("grid: {5: [1]}", "grid.5: a grid key is a dotted config key, e.g. model.rope.fraction"),
    ("variants: [{name: a, 5: 1}]", "variants[0].5: a variant's keys are its name and dotted config keys"),
])
def test_study_keys_of_a_wrong_type_are_one_line(tmp_path, capsys, line, message):
    """Before: `base: 5` and an int grid or variant key ended in AttributeError tracebacks; `name: [1]`,
    `target_loss: x` and `teacher_cache: x` were taken as they were."""
    path = tmp_path / "s.yaml"
    text = {"name": "name: s", "base": "base: {preset: tiny-llama, train: {steps: 2}}", "variants": "variants: [{name: a}]"}
    text[line.split(":")[0]] = line
    path.write_text("\n".join(text.values()) + "\n")
    assert main(["study", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_dry_runs(path, capsys):
    from ropelab.config import load_yaml

    keys = set(load_yaml(path))
    if {"variants", "grid"} & keys:
        assert main(["study", "--config", str(path), "--dry-run"]) == 0
        assert "GPU-hours" in capsys.readouterr().out
    elif "methods" in keys:  # `ropelab eval extrapolation --config`
        from ropelab.evaluate.extrapolation import make_settings

        options = load_yaml(path)
        assert options.pop("runs") and make_settings(**options).lengths
    elif "runs" in keys:  # `ropelab eval longctx --config`
        from ropelab.evaluate.longctx_items import make_settings

        options = load_yaml(path)
        assert options.pop("runs") and make_settings(**options).lengths
    elif "checkpoints" in keys:  # `ropelab probe run --config`
        from ropelab.cli.probe import PROBE_OPTIONS, probe_config

        options = load_yaml(path)
        assert options.pop("checkpoints") and set(options) <= set(PROBE_OPTIONS)
        assert probe_config(options).block_len * probe_config(options).repeats > 0
    else:
        from ropelab.config import build_run_config, load_yaml
        from ropelab.model import count_params_meta

        from ropelab.sources.plans import shape_config

        config = build_run_config(load_yaml(path))
        config.model.vocab_size = config.model.vocab_size or 4096
        assert count_params_meta(shape_config(config.model)) > 0


def test_paper_configs_carry_the_seeds_batch():
    runs = expand(load_study(Path(__file__).parents[2] / "configs/paper/rq1-fractions-llama1b.yaml"))
    config = runs[0].config
    assert config.train.global_batch == 4096 and config.data.seq_len == 2048 and config.train.steps == 12_000
    assert len(runs) == 7
