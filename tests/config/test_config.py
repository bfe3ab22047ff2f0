import subprocess
import sys

import pytest

from ropelab.cli import main
from ropelab.config import ConfigError, ModelConfig, RunConfig, build_run_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.rope.fraction=1.5", "model.rope.fraction"),
        ("model.rope.fraction=-0.1", "model.rope.fraction"),
        ("model.rope.rotary_dims=3", "model.rope.rotary_dims"),
        ("model.rope.rotary_dims=66", "model.rope.rotary_dims"),
        ("model.n_head=5", "model.n_head"),
        ("model.n_kv_head=3", "model.n_kv_head"),
        ("model.rope.theta=0", "model.rope.theta"),
        ("model.rope.layout=zigzag", "model.rope.layout"),
        ("model.nonsense=1", "model.nonsense"),
        ("train.stepz=3", "train.stepz"),
        ("train.steps=abc", "train.steps"),
        ("data.seq_len=100000", "data.seq_len"),
        ("model.rope_layers={9: {fraction: 0}}", "model.rope_layers.9"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        build_run_config(overrides=[override])
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="tiny-llama"):
        ModelConfig.from_name("gpt-17")


def test_overrides_merge_over_preset_and_yaml():
    cfg = build_run_config({"model": {"rope": {"theta": 500000}}, "seed": 3}, "tiny-pythia", ["model.rope.fraction=0.5"])
    assert cfg.model.block == "parallel" and cfg.model.rope.fraction == 0.5 and cfg.model.rope.theta == 500000
    assert cfg.seed == 3


def test_per_layer_rope_override():
    cfg = build_run_config(overrides=["model.rope_layers={1: {fraction: 0}}"]).model
    assert cfg.rope_for_layer(1).fraction == 0 and cfg.rope_for_layer(0).fraction == 1.0


def test_yaml_roundtrip():
    cfg = build_run_config(preset="tiny-pythia")
    import yaml

    assert build_run_config(yaml.safe_load(cfg.to_yaml())) == cfg


def test_cli_reports_one_line_and_exit_code_2(capsys, tmp_path):
    code = main(["train", "--out", str(tmp_path / "r"), "model.rope.fraction=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "model.rope.fraction=2" in err
    assert not (tmp_path / "r").exists()


def test_cli_missing_config_file(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_default_run_config_is_valid():
    assert RunConfig().validate().model.name == "tiny-llama"


@pytest.mark.parametrize("override, message", [
    ("train.lr=.inf", "train.lr=inf: must be a finite number"),
    ("train.lr=.nan", "train.lr=nan: must be a finite number"),
    ("train.lr=2", "train.lr=2.0: must be in (0, 1]"),
    ("train.grad_clip=.nan", "train.grad_clip=nan: must be a finite number"),
    ("train.grad_clip=0", "train.grad_clip=0.0: must be a finite number > 0"),
    ("train.beta1=1.5", "train.beta1=1.5: must be in [0, 1)"),
    ("train.eps=1e-300", "train.eps=1e-300: must be a finite number >= 1.1754943508222875e-38"),
    ("train.weight_decay=5000", "train.weight_decay=5000.0: must be < 1 / train.lr = 2500"),
    ("model.init_std=.nan", "model.init_std=nan: must be a finite number"),
    ("model.init_std=-0.02", "model.init_std=-0.02: must be in (0, 1]"),
    ("model.n_kv_head=0", "model.n_kv_head=0: must be > 0"),
    ("model.d_model=4294967296", "model.d_model=4294967296: must be <= 2147483647"),
    ("seed=-1", "seed=-1: must be >= 0"),
    ("data.val_percent=1e999", "data.val_percent=inf: must be a finite number"),
    ("model.rope.theta=-.inf", "model.rope.theta=-inf: must be a finite number"),
    ("model.rope.scaling={method: yarn, factor: 2, original_max_position: 8, attention_factor: 1e6}",
     "model.rope.scaling.attention_factor=1000000.0: must be in (0, 100]"),
    ("train.phases=[{name: a, tokens: 2.0e+16}]", "train.phases[0].tokens=20000000000000000: must be <= 9007199254740992"),
])
def test_numbers_out_of_range_are_one_line_and_write_nothing(tmp_path, capsys, override, message):
    """Before: lr=inf and grad_clip=nan trained to "done" on NaN losses; lr=nan, beta1=1.5, init_std=nan and
    seed=-1 ended in tracebacks and left a config.yaml that blocked a rerun."""
    assert main(["train", "--out", str(tmp_path / "r"), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ropelab: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_importing_the_config_does_not_import_torch():
    """Reading and checking a config (the CLI's first step, `ropelab.config`) stays cheap: no torch."""
    code = ("import sys, ropelab.config; ropelab.config.build_run_config(preset='tiny-pythia'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"
