"""The extrapolation study on the shared tiny run (trained at 32 tokens): `none` is the long-context loss by
position, each method's frequencies are rope_scaling's, NoPE and factor-1 cells are none's, a run trained
with a scaling keeps it as its base, bad input is one line, and the CLI (the study's section: tests/study)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from ropelab import sources
from ropelab.cli import main
from ropelab.config import ConfigError, RopeScalingConfig
from ropelab.evaluate.extrapolation import evaluate_extrapolation, make_settings, plan_cells
from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.rope.scaling import scale_frequencies

QUICK = dict(windows=2, passkey=False, progress=False)


def edited_copy(run, folder, **model_rope) -> str:
    """A copy of `run` whose config.yaml sets `model.rope` keys (RoPE has no weights: the same state dict loads)."""
    copy = folder / "run"
    shutil.copytree(run, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["model"]["rope"].update(model_rope)
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    return str(copy)


@pytest.fixture(scope="module")
def nope_run(run, tmp_path_factory):
    return edited_copy(run, tmp_path_factory.mktemp("nope"), fraction=0.0, rotary_dims=None)


@pytest.fixture(scope="module")
def yarn_run(run, tmp_path_factory):
    """As if fine-tuned at 32 tokens with YaRN x2 from 16."""
    return edited_copy(run, tmp_path_factory.mktemp("yarn"),
                       scaling={"method": "yarn", "factor": 2.0, "original_max_position": 16})


def cells_of(results: dict, run: int = 0) -> dict:
    return {(c["method"], c["length"]): c for c in results["runs"][run]["cells"]}


def test_none_is_the_long_context_loss_by_position_and_scaling_changes_it(run, tmp_path):
    results = evaluate_extrapolation([run], tmp_path / "x", lengths=[32], methods=["none", "linear", "ntk"], factor=2.0,
                                     **QUICK)
    longctx = evaluate_longctx([run], tmp_path / "l", tasks=["passkey"], lengths=[160], depths=[0.0], items=1,
                               distractors=2, loss_length=32, loss_windows=2, progress=False)
    cells = cells_of(results)
    assert cells["none", 32]["buckets"] == longctx["runs"][0]["loss_by_position"]["buckets"]
    assert cells["linear", 32]["factor"] == 2.0 and "same_as" not in cells["linear", 32]
    assert abs(cells["linear", 32]["loss_last_half"] - cells["none", 32]["loss_last_half"]) > 1e-4
    assert cells["ntk", 32]["loss_last_half"] != cells["linear", 32]["loss_last_half"]
    assert results["runs"][0]["loss_at_train_len"] == pytest.approx(cells["none", 32]["loss_last_half"])
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["extrapolation.json", "extrapolation.md", "loss_by_position.png"]
    table = (tmp_path / "x" / "extrapolation.md").read_text()
    assert "| method | 32 (1 T0) |" in table and f"| linear | {cells['linear', 32]['loss_last_half']:.3f} |" in table


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "dynamic", "llama3"])
def test_each_method_sets_exactly_the_frequencies_of_rope_scaling(run, method):
    model = sources.load(run).model
    unscaled = model.ropes[0].inv_freq.clone()
    rotary_dims = model.ropes[0].rotary_dims
    cells = plan_cells(run, model.config, 32, make_settings(lengths=[128], methods=[method], passkey=False))
    assert [(c.method, c.factor) for c in cells] == [("none", None), (method, 4.0)]
    model.set_rope_scaling(cells[1].model_config)
    scaling = RopeScalingConfig(method=method, factor=4.0, original_max_position=32)
    expected, attention = scale_frequencies(unscaled, rotary_dims, model.config.rope.theta, scaling,
                                            128 if method == "dynamic" else None)
    model.ropes[0].cos_sin(torch.arange(128)[None])  # dynamic NTK follows the length of the call
    assert torch.equal(model.ropes[0].inv_freq, expected) and model.ropes[0].attention_factor == attention
    if method == "linear":
        assert torch.allclose(expected, unscaled / 4)
    model.set_rope_scaling(cells[0].model_config)  # none: back to the model as trained
    assert torch.equal(model.ropes[0].inv_freq, unscaled)


def test_nope_and_factor_one_cells_are_none_s(run, nope_run, tmp_path):
    results = evaluate_extrapolation([nope_run, run], tmp_path / "x", lengths=[24, 64], **QUICK)
    nope, rope = cells_of(results, 0), cells_of(results, 1)
    assert results["runs"][0]["rotates"] is False and results["runs"][0]["rotary_dims"] == 0
    for method in ("linear", "ntk", "yarn", "dynamic"):
        for length in (24, 64):
            assert nope[method, length]["same_as"] == "none"
            assert nope[method, length]["buckets"] == nope["none", length]["buckets"]
        assert rope[method, 24]["same_as"] == "none" and rope[method, 24]["factor"] is None  # 24 / 32 < 1
        assert "same_as" not in rope[method, 64] and rope[method, 64]["factor"] == 2.0
    assert "NoPE: every method is the model itself" in (tmp_path / "x" / "extrapolation.md").read_text()


def test_a_run_trained_with_scaling_is_scaled_from_its_base_context(yarn_run, tmp_path):
    results = evaluate_extrapolation([yarn_run], tmp_path / "x", lengths=[32, 64], methods=["none", "yarn", "linear"], **QUICK)
    entry, cells = results["runs"][0], cells_of(results)
    assert entry["base_context"] == 16 and entry["train_seq_len"] == 32 and entry["own_scaling"]["method"] == "yarn"
    # at 32 tokens YaRN x 32/16 from 16 is the run's own scaling: none's figures exactly
    assert cells["yarn", 32]["factor"] == 2.0 and cells["yarn", 32]["buckets"] == cells["none", 32]["buckets"]
    assert cells["linear", 32]["buckets"] != cells["none", 32]["buckets"]
    assert cells["yarn", 64]["factor"] == 4.0


def test_passkey_cells_score_every_item_of_their_length(run, tmp_path):
    results = evaluate_extrapolation([run], tmp_path / "x", lengths=[128], methods=["none", "yarn"], windows=1,
                                     depths=[0.0, 1.0], items=1, distractors=3, progress=False)
    for cell in results["runs"][0]["cells"]:
        assert set(cell["passkey"]) == {"exact_match", "mrr", "acc_at_1", "mean_rank"}
        assert 0.25 <= cell["passkey"]["mrr"] <= 1 and 1 <= cell["passkey"]["mean_rank"] <= 4
    assert "Passkey acc@1 / MRR" in (tmp_path / "x" / "extrapolation.md").read_text()


@pytest.mark.parametrize("options, message", [
    ({"methods": ["none", "longrope"]}, "methods=none,longrope: choose one or more of"),
    ({"lengths": []}, "lengths=\\[\\]: give one or more"),
    ({"lengths": [64, 64]}, "lengths=\\[64, 64\\]: has repeats"),
    ({"factor": 1.0}, "factor=1.0: must be a finite number > 1"),
    ({"windows": 0}, "windows=0: must be >= 1"),
    ({"depths": [2.0], "passkey": True}, "depths=\\[2.0\\]"),
    ({"window": 2}, "window: unknown extrapolation option"),
    ({"lengths": [400_000]}, "lengths up to 400000 need windows of 400001 validation tokens"),
])
def test_bad_input_is_one_line_naming_the_key_before_any_work(run, tmp_path, options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        evaluate_extrapolation([run], tmp_path / "x", **({"lengths": [64]} | QUICK | options))
    assert "\n" not in str(caught.value) and not (tmp_path / "x").exists()


def test_a_method_a_layer_cannot_take_is_refused_naming_run_method_and_key(run, tmp_path):
    two_channels = edited_copy(run, tmp_path, fraction=1.0, rotary_dims=2)
    with pytest.raises(ConfigError, match=r"methods=ntk at 64 tokens: model.rope.scaling.method=ntk: needs a spectrum"):
        evaluate_extrapolation([two_channels], tmp_path / "x", lengths=[64], **QUICK)
    with pytest.raises(ConfigError, match="nothing: no such file or directory"):
        evaluate_extrapolation([tmp_path / "nothing"], tmp_path / "y", lengths=[64], **QUICK)


def test_cli_runs_from_a_config_and_reports_mistakes_in_one_line(run, tmp_path, capsys):
    config = tmp_path / "x.yaml"
    config.write_text(yaml.safe_dump({"runs": [str(run)], "lengths": [64], "methods": ["none", "yarn"], "windows": 1,
                                      "passkey": False}))
    assert main(["eval", "extrapolation", "--config", str(config), "--out", str(tmp_path / "ok"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| yarn |" in out and "extrapolation.json" in out
    assert json.loads((tmp_path / "ok" / "extrapolation.json").read_text())["settings"]["passkey"] is False
    assert main(["eval", "extrapolation", str(run), "--lengths", "64", "--methods", "none,rope", "--out",
                 str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "methods=none,rope" in err


def test_a_scaled_config_scales_every_rotating_layer_kind_and_no_nope_one():
    from ropelab.config import LayerKind, ModelConfig
    from ropelab.evaluate.extrapolation import scaled_config

    config = ModelConfig(vocab_size=64, n_layer=3, d_model=64, n_head=2, layer_pattern="LGN", layer_kinds={
        "L": LayerKind(attention="sliding", window=8), "N": LayerKind(rope="none"),
        "G": LayerKind(rope={"theta": 1e6, "scaling": {"method": "linear", "factor": 2.0}})})
    yarn = RopeScalingConfig(method="yarn", factor=4.0, original_max_position=32)
    scaled = scaled_config(config, yarn, "methods=yarn")
    assert [scaled.rope_for_layer(layer).scaling for layer in range(3)] == [yarn, yarn, None]  # N is NoPE
    assert scaled.rope_for_layer(1).theta == 1e6 and scaled.rope_for_layer(2).resolve_dims(32) == 0
    assert config.layer_kinds["G"].rope["scaling"]["method"] == "linear"  # the model's own config is left alone


@pytest.mark.parametrize("overrides, unscaled", [
    (["model.position_layers={1: [{type: fope, trained_length: 64}]}"], [1]),
    (["model.layer_pattern=RF", "model.layer_kinds={R: {}, F: {position: [{type: fope, trained_length: 64}]}}"], [1, 3]),
])
def test_scaling_leaves_each_layer_whose_rotation_refuses_it_unscaled(overrides, unscaled):
    """Per layer, not by layer 0: a FoPE layer among RoPE layers keeps its frequencies as trained."""
    from ropelab.config import build_run_config
    from ropelab.config.rope import RopeScalingConfig
    from ropelab.evaluate.extrapolation import rotates, scaled_config
    from ropelab.model import Transformer

    config = build_run_config(overrides=["model.vocab_size=64", *overrides]).model
    yarn = RopeScalingConfig(method="yarn", factor=2.0, original_max_position=64)
    scaled = scaled_config(config, yarn, "extrapolation.methods")
    assert rotates(config)
    assert [scaled.rope_for_layer(layer).scaling is None for layer in range(4)] == [l in unscaled for l in range(4)]
    scaled.validate()  # no "type fope takes no model.rope.scaling"
    assert config.rope_for_layer(0).scaling is None and config.rope_layers == {}  # the run's own config untouched
    model = Transformer(config)
    model.set_rope_scaling(scaled)
    assert [block.attn.rope.config.scaling is None for block in model.blocks] == [l in unscaled for l in range(4)]


def test_a_refusal_names_the_encodings_of_every_layer():
    from ropelab.config import build_run_config
    from ropelab.evaluate.extrapolation import scaling_refusal

    config = build_run_config(overrides=["model.position=[{type: nope}]",
                                         "model.position_layers={2: [{type: alibi}]}"]).model
    assert scaling_refusal(config).startswith("ALiBi: every method is the model itself")
