"""train.init_from: a run starts from another run's weights with a fresh optimizer; the source's
shape and tokenizer are the defaults; mismatches stop before any work with one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from ropelab.config import ConfigError, build_run_config
from ropelab.model import Transformer
from ropelab.sources import load, run_config
from ropelab.train.loop import train


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, tiny_session_overrides):
    run_dir = tmp_path_factory.mktemp("init") / "source"
    train(build_run_config(overrides=[*tiny_session_overrides, "model.d_model=32", "model.n_head=2",
                                      "model.n_kv_head=1"]), run_dir)
    return run_dir


def test_source_shape_and_tokenizer_are_the_defaults(source_run):
    config = run_config(overrides=[f"train.init_from={source_run}", "model.rope.theta=500000"])
    source = load(source_run).config
    assert (config.model.d_model, config.model.n_head, config.model.kv_heads) == (32, 2, 1)
    assert config.model.vocab_size == source.model.vocab_size and config.data.tokenizer == "bytes"
    assert config.model.rope.theta == 500_000  # a setting that keeps the weight shapes may differ


def test_fine_tune_starts_from_the_source_weights_and_resumes(source_run, tmp_path, tiny_session_overrides):
    not_model = [o for o in tiny_session_overrides if not o.startswith("model.")]
    overrides = [*not_model, f"train.init_from={source_run}", "train.steps=4", "train.lr=1e-9",
                 "model.rope.theta=20000"]
    config = run_config(overrides=overrides)
    result = train(config, tmp_path / "tuned")
    assert result.init_from["source"] == str(source_run) and result.init_from["kind"] == "run"
    saved = json.loads((tmp_path / "tuned" / "result.json").read_text())
    assert saved["init_from"]["checkpoint"].endswith("step_00000008")
    tuned, source = load(tmp_path / "tuned").model, load(source_run).model
    for (name, a), b in zip(tuned.state_dict().items(), source.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)  # lr 1e-9: four steps move nothing visible
    assert tuned.ropes[0].theta == 20_000

    first = train(run_config(overrides=[*overrides, "train.steps=8"]), tmp_path / "straight")
    train(run_config(overrides=[*overrides, "train.steps=8", "train.checkpoint_every=4"]), tmp_path / "cut")
    (tmp_path / "cut" / "result.json").unlink()
    resumed = train(out_dir=tmp_path / "cut", resume=True, from_checkpoint=4)
    assert resumed.final_train_loss == first.final_train_loss and resumed.init_from == first.init_from


@pytest.mark.parametrize("override, message", [
    ("model.d_model=64", "model.d_model=64 but the source has 32"),
    ("data.tokenizer=bpe:300", "is not the source's tokenizer"),
])
def test_mismatch_stops_before_any_work(source_run, tmp_path, tiny_session_overrides, override, message):
    not_model = [o for o in tiny_session_overrides if not o.startswith("model.")]
    config = run_config(overrides=[*not_model, f"train.init_from={source_run}", override])
    with pytest.raises(ConfigError, match=message) as info:
        train(config, tmp_path / "bad")
    assert "\n" not in str(info.value) and not (tmp_path / "bad").exists()


def test_missing_source_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        run_config(overrides=[f"train.init_from={tmp_path / 'nope'}"])


def _plan_run(source_run, tiny_overrides, *extra):
    return run_config({}, None, [*(o for o in tiny_overrides if not o.startswith("model.")), f"train.init_from={source_run}",
                                 "model.rope.keep_pairs=3", "model.rope.select=2-norm", "train.calibration_tokens=256",
                                 *extra])


def test_a_plan_converts_the_source_at_the_start_and_resumes_exactly(source_run, tiny_overrides, tmp_path):
    whole = train(_plan_run(source_run, tiny_overrides), tmp_path / "whole")
    conversion = whole.init_from["conversion"]
    assert conversion["select"] == "2-norm" and conversion["keep_pairs"] == 3 and conversion["kl_to_source"] > -1e-6
    saved = yaml.safe_load((tmp_path / "whole" / "config.yaml").read_text())["model"]
    assert {int(k): v["pairs"] for k, v in saved["rope_layers"].items()} == {
        layer: p if len({tuple(h) for h in p}) > 1 else p[0] for layer, p in enumerate(conversion["pairs"])}
    first = json.loads((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[0])
    assert first == {"step": 0, "tokens": 0, "val_loss": pytest.approx(conversion["loss_converted"], rel=1e-5)}

    def stop_at_step_5(row):  # after the step-4 checkpoint
        if row["step"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_plan_run(source_run, tiny_overrides), tmp_path / "cut", callbacks=(stop_at_step_5,))
    resumed = train(out_dir=tmp_path / "cut", resume=True)
    assert resumed.final_train_loss == whole.final_train_loss and resumed.init_from == whole.init_from


def test_zero_steps_saves_the_converted_weights(source_run, tiny_overrides, tmp_path):
    result = train(_plan_run(source_run, tiny_overrides, "train.steps=0"), tmp_path / "conv")
    assert result.steps == 0 and result.final_val_loss == pytest.approx(result.init_from["conversion"]["loss_converted"], rel=1e-5)
    model = load(tmp_path / "conv").model
    assert model.ropes[0].rotary_dims == 6 and len(model.ropes) >= 1
    with pytest.raises(ConfigError, match="train.steps=0: must be > 0"):
        build_run_config(overrides=["train.steps=0"])


def test_nope_from_a_full_rope_source_records_the_conversion(source_run, tiny_overrides, tmp_path):
    config = run_config({}, None, [*(o for o in tiny_overrides if not o.startswith("model.")),
                                   f"train.init_from={source_run}", "model.rope.fraction=0", "train.steps=0"])
    record = train(config, tmp_path / "nope").init_from["conversion"]
    assert record["select"] == "nope" and record["keep_pairs"] == 0 and record["pairs"] == [[[]], [[]]]


def test_the_runs_channel_choice_replaces_the_sources(tmp_path, tiny_overrides):
    """An imported source names rotary_dims: a run asking for NoPE or a plan must not keep it."""
    source = tmp_path / "source"
    train(build_run_config(overrides=[*tiny_overrides, "model.rope.rotary_dims=16", "train.steps=1"]), source)
    base = [o for o in tiny_overrides if not o.startswith("model.")] + [f"train.init_from={source}"]
    assert run_config({}, None, base).model.rope.rotary_dims == 16
    assert run_config({}, None, [*base, "model.rope.fraction=0"]).model.rope.resolve_dims(16) == 0
    from_yaml = run_config({"model": {"rope": {"keep_pairs": 2, "select": "low"}}}, None, base).model.rope
    assert from_yaml.rotary_dims is None and from_yaml.resolve_dims(16) == 4


def test_a_depth_pruned_student_equals_a_model_of_the_kept_layers(source_run, tmp_path, tiny_session_overrides):
    not_model = [o for o in tiny_session_overrides if not o.startswith("model.")]
    config = run_config(overrides=[*not_model, f"train.init_from={source_run}", "train.init_layers=[1]",
                                   "train.steps=0"])
    assert config.model.n_layer == 1 and load(source_run).config.model.n_layer == 2
    train(config, tmp_path / "pruned")
    pruned, source = load(tmp_path / "pruned").model, load(source_run).model
    hand_built = Transformer(dataclasses.replace(source.config, n_layer=1)).eval()
    hand_built.embed.load_state_dict(source.embed.state_dict())
    hand_built.final_norm.load_state_dict(source.final_norm.state_dict())
    hand_built.lm_head.load_state_dict(source.lm_head.state_dict())
    hand_built.blocks[0].load_state_dict(source.blocks[1].state_dict())
    tokens = torch.randint(0, source.config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(pruned(tokens)[0], hand_built(tokens)[0], atol=0, rtol=0)
    assert json.loads((tmp_path / "pruned" / "result.json").read_text())["init_from"]["layers"] == [1]


def test_a_rope_transplant_changes_only_the_rope_frequencies(source_run, tmp_path, tiny_session_overrides):
    not_model = [o for o in tiny_session_overrides if not o.startswith("model.")]
    train(run_config(overrides=[*not_model, f"train.init_from={source_run}", "train.steps=0",
                                "model.rope.theta=1000"]), tmp_path / "transplant")
    transplant, source = load(tmp_path / "transplant").model, load(source_run).model
    for (name, a), b in zip(transplant.state_dict().items(), source.state_dict().values()):
        assert torch.equal(a, b), name
    frequencies = [rope.inv_freq for rope in (transplant.ropes[0], source.ropes[0])]
    assert not torch.equal(*frequencies) and frequencies[0].shape == frequencies[1].shape
    source.set_rope_theta(1000)
    tokens = torch.randint(0, source.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(transplant(tokens)[0], source(tokens)[0], atol=0, rtol=0)


@pytest.mark.parametrize("override, message", [
    ("train.init_layers=[0, 9]", r"train.init_layers=\[0, 9\]: the source .* has layers 0..1"),
    ("train.init_layers=[-1]", "must be a list of layer indices"),
    ("model.n_layer=3", "train.init_layers: 2 layers but model.n_layer=3"),
])
def test_bad_kept_layers_stop_in_one_line(source_run, tmp_path, tiny_session_overrides, override, message):
    not_model = [o for o in tiny_session_overrides if not o.startswith("model.")]
    with pytest.raises(ConfigError, match=message) as info:
        config = run_config(overrides=[*not_model, f"train.init_from={source_run}", "train.init_layers=[1, 0]",
                                       override])
        train(config, tmp_path / "bad")
    assert "\n" not in str(info.value) and not (tmp_path / "bad").exists()
