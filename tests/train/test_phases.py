"""Multi-phase runs: per-phase steps, batch, length and RoPE theta; boundary checkpoints; exact resume."""

import json
import math
import shutil

import pytest
import torch

from ropelab.config import ConfigError, build_run_config
from ropelab.model import Transformer
from ropelab.rope import RotaryEmbedding
from ropelab.sources import load
from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics
from ropelab.rope.bound import first_negative
from ropelab.train.phases import base_warnings, resolve_phases

PHASES = {"train": {"phases": [
    {"name": "short", "steps": 6, "overrides": {"model.rope.theta": 10000, "train.lr": 3e-3}},
    {"name": "long", "tokens": 1024, "overrides": {"model.rope.theta": 500000, "data.seq_len": 64, "train.micro_batch": 2,
                                                   "train.lr": 3e-4, "attention.doc_mask": True}},
]}}


def phased_config(tiny_overrides, *extra):
    return build_run_config(PHASES, overrides=tiny_overrides + ["train.checkpoint_every=3", *extra])


def test_phases_resolve_to_consecutive_step_ranges(tiny_overrides):
    phases = resolve_phases(phased_config(tiny_overrides))
    assert [(p.name, p.start, p.end) for p in phases] == [("short", 0, 6), ("long", 6, 14)]  # 1024 / (2 * 64) = 8
    long = phases[1].config
    assert (long.data.seq_len, long.train.micro_batch, long.model.rope.theta, long.attention.doc_mask) == (64, 2, 500000, True)
    assert phases[0].config.data.seq_len == 32 and phases[0].config.train.steps == 6


@pytest.mark.parametrize("phase, message", [
    ({"name": "a", "steps": 0}, "steps=0: must be > 0"),
    ({"name": "a"}, "exactly one of steps or tokens"),
    ({"name": "a", "steps": 2, "overrides": {"model.d_model": 32}}, "fixed for the whole run"),
    ({"name": "a", "steps": 2, "overrides": {"model.rope.theta": -1}}, "theta=-1.0: must be a finite number > 0"),
    ({"name": "a", "steps": 2, "overrides": {"train.nope": 1}}, "train.nope: unknown key"),
])
def test_bad_phase_lists_are_refused_before_work_starts(tiny_overrides, phase, message):
    with pytest.raises(ConfigError, match=message):
        resolve_phases(build_run_config({"train": {"phases": [phase]}}, overrides=tiny_overrides))


def test_theta_switch_changes_cos_sin_and_nothing_else():
    config = build_run_config(overrides=["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.vocab_size=64"]).model
    model = Transformer(config)
    idx = torch.randint(0, 64, (1, 40))
    model(idx)  # fills the cos/sin table at theta 10k
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    before = model(idx)[0]
    model.set_rope_theta(500000)
    fresh = Transformer(build_run_config(overrides=["model.n_layer=2", "model.d_model=64", "model.n_head=2",
                                                    "model.vocab_size=64", "model.rope.theta=500000"]).model)
    fresh.load_state_dict(weights)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    pos = torch.arange(40).unsqueeze(0)
    for a, b in zip(model.ropes[0].cos_sin(pos), fresh.ropes[0].cos_sin(pos)):
        assert torch.equal(a, b)
    after = model(idx)[0]
    assert torch.equal(after, fresh(idx)[0]) and not torch.allclose(after, before)


def test_phased_run_checkpoints_each_boundary_and_reports_each_phase(tmp_path, tiny_overrides):
    result = train(phased_config(tiny_overrides), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["phase"] for r in rows] == ["short"] * 6 + ["long"] * 8
    assert rows[6]["tokens"] - rows[5]["tokens"] == 2 * 64 and rows[5]["tokens"] == 6 * 4 * 32
    assert rows[6]["lr"] < rows[5]["lr"]  # phase 2 warms up to its own, lower peak
    assert [p["name"] for p in result.phases] == ["short", "long"] and result.steps == 14
    assert result.phases[0]["val_loss"] == [r for r in rows if r["step"] == 6][0]["val_loss"]
    assert ckpt.phase_checkpoints(tmp_path / "run") == {"short": ckpt.step_dir(tmp_path / "run", 6),
                                                        "long": ckpt.step_dir(tmp_path / "run", 14)}
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["phases"][1]["end_step"] == 14


def test_resume_inside_the_second_phase_is_exact(tmp_path, tiny_overrides):
    full = tmp_path / "full"
    train(phased_config(tiny_overrides, "train.keep_checkpoints=10"), full)
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for late in ckpt.list_checkpoints(part):
        if int(late.name.split("_")[1]) > 9:
            shutil.rmtree(late)
    (part / "result.json").unlink()
    resumed = train(out_dir=part, resume=True)  # from step 9: theta, length and schedule of phase "long"
    assert [(r["step"], r["loss"]) for r in read_metrics(part)] == [(r["step"], r["loss"]) for r in read_metrics(full)]
    assert [p["name"] for p in resumed.phases] == ["short", "long"]


def test_a_phase_switches_yarn_on_in_training(monkeypatch, tmp_path, tiny_overrides):
    """Phase 2 of a run trains with the YaRN it switches on; the checkpoint loads with it."""
    seen, forward = [], RotaryEmbedding.forward

    def recording(self, q, k, position_ids, **kwargs):
        seen.append(None if self.config.scaling is None else self.config.scaling.method)
        return forward(self, q, k, position_ids, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "forward", recording)
    config = build_run_config(overrides=[*tiny_overrides, "train.eval_every=2", "train.checkpoint_every=2",
        "train.phases=[{name: short, steps: 2}, {name: long, steps: 2}]",
        "train.phases[1].overrides.model.rope.scaling={method: yarn, factor: 4, original_max_position: 32}",
        "train.phases[1].overrides.data.seq_len=64"])
    train(config, tmp_path / "run")
    switch = seen.index("yarn")
    assert set(seen[:switch]) == {None} and set(seen[switch:]) == {"yarn"}
    rope = load(tmp_path / "run").model.ropes[0]
    assert rope.config.scaling.method == "yarn" and rope.attention_factor == pytest.approx(0.1 * math.log(4) + 1)


def test_a_phase_below_the_base_bound_warns_in_one_line(tiny_overrides, tmp_path, capsys):
    config = build_run_config(overrides=[*tiny_overrides, "train.phases=[{name: short, steps: 1}, {name: long, steps: 1}]",
                                         "train.phases[1].overrides.data.seq_len=64",
                                         "train.phases[1].overrides.model.rope.theta=3"])
    lines = base_warnings(resolve_phases(config))
    assert len(lines) == 1 and "phase 'long': RoPE theta 3 on 16 rotary dims (every layer)" in lines[0]
    distance = int(lines[0].split("from distance ")[1].split(" ")[0])
    assert distance == first_negative(3.0, 16, 63)  # the layer's own frequencies are the slice spectrum here
    train(config, tmp_path / "run")
    assert lines[0] in capsys.readouterr().err.splitlines()
    linear = build_run_config(overrides=[*tiny_overrides, "model.rope.theta=3", "data.seq_len=64",
                                         "model.rope.scaling={method: linear, factor: 8}"])
    scaled = int(base_warnings(resolve_phases(linear))[0].split("from distance ")[1].split(" ")[0])
    assert scaled > distance  # the scaled frequencies are the ones checked: positions turn 8x slower
    nope = build_run_config(overrides=[*tiny_overrides, "model.rope.fraction=0", "data.seq_len=64"])
    assert base_warnings(resolve_phases(nope)) == []


@pytest.mark.parametrize("position, key, thetas", [
    # model.position's rotation entry sets theta: laid over model.rope when the phase's config is built, it
    # undid the phase's switch (every phase ran at 500)
    (["model.position=[{type: rope, theta: 500}, {type: alibi}]"], "model.rope.theta", [[500.0] * 2, [1e6] * 2]),
    (["model.position=[{type: rope, fraction: 0.5}, {type: alibi}]"], "model.rope.theta", [[1e4] * 2, [1e6] * 2]),
    # a kind with its own list has no `rope`: its theta switch goes into the list's rotation entry
    (["model.layer_pattern=AB", "model.layer_kinds={A: {position: [{type: fope, trained_length: 64}]}, B: {}}"],
     "model.layer_kinds.A.rope.theta", [[1e4, 1e4], [1e6, 1e4]]),
    # a layer's own list keeps its RoPE keys, as a model.rope_layers entry does
    (["model.position_layers={1: [{type: rope, theta: 500}]}"], "model.rope.theta", [[1e4, 500.0], [1e6, 500.0]]),
])
def test_a_phases_theta_switch_reaches_layers_whose_list_spells_their_rope_keys(tiny_overrides, position, key, thetas):
    phases = resolve_phases(build_run_config(
        {"train": {"phases": [{"name": "a", "steps": 2}, {"name": "b", "steps": 2, "overrides": {key: 1e6}}]}},
        overrides=tiny_overrides + position))
    assert [[phase.config.model.rope_for_layer(layer).theta for layer in (0, 1)] for phase in phases] == thetas
