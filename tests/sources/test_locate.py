"""ropelab.sources: what a name is (resolve), and loading a checkpoint with its phase's settings."""

from __future__ import annotations

import pytest
import torch

from ropelab.config import ConfigError, build_run_config
from ropelab.model import Transformer
from ropelab.sources import load, load_config, resolve
from ropelab.sources.imported import save_weights_only

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.vocab_size=320",
        "data.tokenizer=bytes", "data.seq_len=16"]


def tiny_config(*overrides):
    return build_run_config(overrides=[*TINY, *overrides])


def tiny_model(seed):
    torch.manual_seed(seed)
    return Transformer(tiny_config().model)


def write_run(run_dir, model, config, step):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    save_weights_only(run_dir, step, model, config)
    return run_dir


def test_kinds_of_source(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    run = write_run(tmp_path / "run", tiny_model(0), tiny_config(), step=3)
    (run / "config.json").write_text("{}")  # a run that also holds an HF config is still a run

    found = resolve(run)
    assert found.kind == "run" and found.run_dir == run and found.checkpoint.name == "step_00000003"
    checkpoint = resolve(found.checkpoint)
    assert checkpoint.kind == "checkpoint" and checkpoint.run_dir == run and checkpoint.is_ropelab
    assert resolve(tmp_path / "hf").kind == "hf" and not resolve(tmp_path / "hf").is_ropelab
    hub = resolve("meta-llama/Llama-3.2-1B")
    assert hub.kind == "hf" and hub.location == "meta-llama/Llama-3.2-1B"


@pytest.mark.parametrize("name, message", [
    ("runs/missing/x", "no such file or directory"),
    ("./org/name", "no such file or directory"),  # spelled like a path: never a hub lookup
    ("empty", "not a ropelab run directory"),
])
def test_paths_that_name_no_source_give_one_line(tmp_path, monkeypatch, name, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=message) as info:
        resolve(name)
    assert "\n" not in str(info.value)


def test_incomplete_checkpoint_is_refused(tmp_path):
    run = write_run(tmp_path / "run", tiny_model(0), tiny_config(), step=3)
    folder = resolve(run).checkpoint
    (folder / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="incomplete checkpoint"):
        resolve(folder)


def test_checkpoint_of_a_phase_gets_that_phases_theta(tmp_path):
    config = tiny_config("train.phases=[{name: short, steps: 5}, {name: long, steps: 3, overrides: {model.rope.theta: 500000}}]")
    for name, step in (("short", 5), ("long", 8)):
        run = write_run(tmp_path / name, tiny_model(0), config, step=step)
        model, tokenizer, phase_config = load(str(run))
        theta = 10_000.0 if name == "short" else 500_000.0
        assert model.ropes[0].theta == theta and phase_config.model.rope.theta == theta
        assert load_config(run)[0].model.rope.theta == theta
        assert tokenizer.vocab_size <= model.config.vocab_size and not model.training
