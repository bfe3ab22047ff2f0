"""Branches (`train.branch_from`): a run that continues another's whole training state."""

import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ropelab.config import ConfigError, build_run_config
from ropelab.sources.init import run_config
from ropelab.sources.runs import checkpoint_step
from ropelab.train import checkpoint as ckpt
from ropelab.train.branch import branch_point
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics

KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "val_loss")


def curve(run_dir):
    return [{k: row.get(k) for k in KEYS} for row in read_metrics(run_dir)]


def final_weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_session_overrides):
    """12 steps of cosine, a checkpoint every 2 steps (the newest kept), step 4 kept for good."""
    overrides = [*tiny_session_overrides, "train.steps=12", "train.checkpoint_every=2", "train.keep_checkpoints=1",
                 "train.checkpoint_steps=[4]", "train.eval_every=2"]
    run_dir = tmp_path_factory.mktemp("parent") / "run"
    train(build_run_config(overrides=overrides), run_dir)
    return run_dir, overrides


def test_checkpoint_steps_are_kept_for_good(parent):
    run_dir, _ = parent
    # 10: the last known good one when 12 was written (the trainer protects it)
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(run_dir)] == [4, 10, 12]
    assert (ckpt.step_dir(run_dir, 4) / ckpt.KEEP_MARKER).is_file()


def test_branch_with_the_parents_schedule_repeats_its_steps_bit_for_bit(parent, tmp_path):
    run_dir, overrides = parent
    branch = tmp_path / "branch"
    result = train(build_run_config(overrides=[*overrides, f"train.branch_from={run_dir}", "train.branch_step=4"]), branch)
    mine, theirs = curve(branch), curve(run_dir)
    assert [r["step"] for r in mine] == list(range(5, 13))  # steps count on from the parent's
    assert mine == theirs[4:]
    ours, parents = final_weights(branch), final_weights(run_dir)
    assert ours.keys() == parents.keys() and all(torch.equal(ours[k], parents[k]) for k in ours)
    record = json.loads((branch / "result.json").read_text())["branch_from"]
    assert record["step"] == 4 and record["source"] == str(run_dir) and record["checkpoint"].endswith("step_00000004")
    assert result.tokens == curve(run_dir)[-1]["tokens"]  # tokens count from the trunk's start


def test_branch_from_the_newest_checkpoint_with_a_cooldown(parent, tmp_path):
    run_dir, overrides = parent
    branch = tmp_path / "cooldown"
    train(build_run_config(overrides=[*overrides, f"train.branch_from={run_dir}", "train.steps=16", "train.schedule=wsd",
                                      "train.decay_fraction=0.25", "train.warmup_steps=0"]), branch)
    rows = read_metrics(branch)
    assert [r["step"] for r in rows] == [13, 14, 15, 16]
    lr = [r["lr"] for r in rows]
    assert lr[0] == pytest.approx(3e-3) and lr == sorted(lr, reverse=True) and lr[-1] < lr[0]


def test_a_resumed_branch_keeps_its_branch_point(parent, tmp_path):
    run_dir, overrides = parent
    branch = tmp_path / "branch"
    config = build_run_config(overrides=[*overrides, f"train.branch_from={run_dir}", "train.branch_step=4",
                                         "train.keep_checkpoints=10"])
    train(config, branch)
    full = curve(branch)
    for later in ckpt.list_checkpoints(branch):  # as a crash after step 9 would leave it
        if checkpoint_step(later) > 8:
            shutil.rmtree(later)
    (branch / "result.json").unlink()
    train(out_dir=branch, resume=True)
    assert curve(branch) == full
    assert json.loads((branch / "result.json").read_text())["branch_from"]["step"] == 4


@pytest.mark.parametrize("change, message", [
    (["model.d_model=32"], "model.d_model=32 but the source has"),
    (["data.tokenizer=bpe:300"], "tokenizer"),
    (["train.steps=4"], "must train further"),
    (["train.branch_step=3"], "no complete checkpoint"),
])
def test_a_branch_that_cannot_continue_stops_before_any_work(parent, tmp_path, change, message):
    run_dir, overrides = parent
    config_overrides = [*overrides, f"train.branch_from={run_dir}", "train.branch_step=4", *change]
    with pytest.raises(ConfigError, match=message) as caught:
        train(build_run_config(overrides=config_overrides), tmp_path / "branch")
    assert "\n" not in str(caught.value) and not (tmp_path / "branch").exists()


def test_branch_and_init_from_together_are_refused(parent):
    run_dir, overrides = parent
    with pytest.raises(ConfigError, match="give one"):
        build_run_config(overrides=[*overrides, f"train.branch_from={run_dir}", f"train.init_from={run_dir}"])


# A parent whose layers do not rotate as the preset's: every second layer NoPE, a quarter of the
# channels rotated at theta 5e5 in the others (issue #52: a branch of it trained all-RoPE at theta 1e4).
LAYOUT = ["model.layer_pattern=RN", "model.layer_kinds={R: {}, N: {rope: none}}", "model.rope.fraction=0.25",
          "model.rope.theta=500000"]


@pytest.fixture(scope="module")
def hybrid_parent(tmp_path_factory, tiny_session_overrides):
    overrides = [*tiny_session_overrides, "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2",
                 "train.eval_every=2"]
    run_dir = tmp_path_factory.mktemp("hybrid") / "run"
    train(build_run_config(overrides=[*overrides, *LAYOUT]), run_dir)
    return run_dir, overrides


def test_a_branch_command_keeps_the_parents_layout_fraction_and_theta(hybrid_parent, tmp_path):
    from ropelab.cli import main

    run_dir, overrides = hybrid_parent
    branch = tmp_path / "branch"
    assert main(["train", "--out", str(branch), *overrides, f"train.branch_from={run_dir}", "train.branch_step=2"]) == 0
    saved = yaml.safe_load((branch / "config.yaml").read_text())["model"]
    assert saved["layer_pattern"] == "RN" and saved["layer_kinds"]["N"]["rope"] == "none"
    assert (saved["rope"]["fraction"], saved["rope"]["theta"]) == (0.25, 500000)
    assert curve(branch) == curve(run_dir)[2:]  # it repeats the parent's steps 3 and 4


@pytest.mark.parametrize("change, message", [
    ([], "layer 0 has rope.theta 10000.0 but the parent's has 500000.0"),  # the library's defaults: the preset's
    ([*LAYOUT, "model.rope.fraction=1.0"], "layer 0 has rotary channels 16 but the parent's has 4"),
    ([*LAYOUT, "model.layer_pattern=RR"], "layer 1 has rotary channels 4 but the parent.s has 0"),
])
def test_a_branch_that_would_rotate_otherwise_than_its_parent_is_refused(hybrid_parent, tmp_path, change, message):
    run_dir, overrides = hybrid_parent
    config = build_run_config(overrides=[*overrides, *change, f"train.branch_from={run_dir}", "train.branch_step=2"])
    with pytest.raises(ConfigError, match=message) as caught:
        train(config, tmp_path / "branch")
    assert "\n" not in str(caught.value) and "train.init_from" in str(caught.value)
    assert not (tmp_path / "branch").exists()


@pytest.mark.parametrize("step", [None, 6])  # the newest (10 or 12, pruned at the next save), one never kept
def test_a_branch_from_a_parent_still_training_says_so(parent, tmp_path, step):
    from ropelab.train.branch import branch_point
    from ropelab.train.lock import RunLock

    run_dir, overrides = parent
    chosen = [f"train.branch_from={run_dir}", "train.steps=16"] + ([] if step is None else [f"train.branch_step={step}"])
    with RunLock(run_dir):  # the parent's trainer
        with pytest.raises(ConfigError, match=rf"the parent is still training \(pid {os.getpid()} on ") as caught:
            train(build_run_config(overrides=[*overrides, *chosen]), tmp_path / "branch")
        assert "\n" not in str(caught.value) and not (tmp_path / "branch").exists()
        kept = branch_point(build_run_config(overrides=[*overrides, *chosen[:2], "train.branch_step=4"]))
        assert kept.step == 4  # a step of its train.checkpoint_steps, never pruned: a branch point meanwhile


def test_a_branch_takes_the_model_its_phased_parent_held_at_the_checkpoint(tmp_path, tiny_session_overrides):
    """The parent's theta moves from 10k to 500k at step 4: a branch from step 6 continues with 500k, one
    from step 2 with 10k, without the user restating either (`ropelab train`'s defaults: run_config)."""
    phases = {"train": {"phases": [{"name": "short", "steps": 4, "overrides": {"model.rope.theta": 10000}},
                                   {"name": "long", "steps": 4, "overrides": {"model.rope.theta": 500000}}]}}
    run_dir = tmp_path / "parent"
    train(build_run_config(phases, overrides=[*tiny_session_overrides, "train.checkpoint_every=2",
                                              "train.keep_checkpoints=4"]), run_dir)
    for step, theta in ((6, 500000), (2, 10000)):
        config = run_config(overrides=[*tiny_session_overrides, f"train.branch_from={run_dir}",
                                       f"train.branch_step={step}", "train.steps=8"])
        assert config.model.rope.theta == theta
        assert branch_point(config).step == step
    newest = run_config(overrides=[*tiny_session_overrides, f"train.branch_from={ckpt.step_dir(run_dir, 6)}",
                                   "train.steps=8"])
    assert newest.model.rope.theta == 500000
