"""Bad steps (non-finite loss or gradients, loss spikes) are skipped before they touch the weights."""

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ropelab.config import build_run_config
from ropelab.errors import TrainingDiverged
from ropelab.train import checkpoint as ckpt
from ropelab.train.objectives import cross_entropy_objective
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics


class Faulty:
    """Cross-entropy, except that chosen steps (1-based) get a NaN loss, an Inf gradient or a spike."""

    def __init__(self, config, nan_steps=(), inf_grad_steps=(), spike_steps=()):
        self.ce = cross_entropy_objective(z_loss=config.train.z_loss)
        self.nan, self.inf, self.spike = set(nan_steps), set(inf_grad_steps), set(spike_steps)
        self.calls = 0
        self.weights = {}  # call -> the weights that step started from

    def __call__(self, model, batch):
        self.calls += 1  # one micro-batch per step in these tests
        self.weights[self.calls] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        loss, logged = self.ce(model, batch)
        if self.calls in self.nan:
            loss = loss * float("nan")
        if self.calls in self.inf:
            model.embed.weight.register_hook(lambda g: g * float("inf") if self.calls in self.inf else g)
        if self.calls in self.spike:
            loss = loss * 50
        return loss, logged


def full_state(checkpoint, tmp_path):
    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "dcp", out)
    return torch.load(out, weights_only=False)


def assert_states_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_states_equal(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("fault", ["nan_steps", "inf_grad_steps"])
def test_bad_step_leaves_weights_and_optimizer_untouched(tmp_path, tiny_overrides, fault):
    config = build_run_config(overrides=tiny_overrides + ["train.checkpoint_every=1", "train.keep_checkpoints=20"])
    faulty = Faulty(config, **{fault: [5]})
    result = train(config, tmp_path / "run", objective=faulty)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert rows[5]["skipped"] == "non-finite" and rows[5]["skipped_total"] == 1 and result.skipped_steps == 1
    assert "skipped" not in rows[4] and "skipped" not in rows[6]
    assert_states_equal(faulty.weights[5], faulty.weights[6])  # what step 6 starts from is what step 5 did
    assert not ckpt.step_dir(tmp_path / "run", 5).exists()  # no checkpoint of a state reached by skipped steps only
    before, after = (full_state(ckpt.step_dir(tmp_path / "run", s), tmp_path) for s in (4, 6))
    steps = lambda state: {int(v["step"]) for v in state["optim"]["state"].values()}  # noqa: E731
    assert steps(before) == {4} and steps(after) == {5}  # the optimizer never saw step 5
    assert rows[8]["loss"] == rows[8]["loss"]  # training carries on with finite losses


def test_consecutive_bad_steps_stop_the_run_naming_the_last_good_checkpoint(tmp_path, tiny_overrides):
    config = build_run_config(overrides=tiny_overrides + ["train.max_bad_steps=2", "train.steps=20"])
    with pytest.raises(TrainingDiverged, match="2 consecutive bad steps .* the last good checkpoint is .*step_00000004"):
        train(config, tmp_path / "run", objective=Faulty(config, nan_steps=range(6, 30)))
    assert not (tmp_path / "run" / "result.json").exists()
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000004"  # steps 5 applied, 6-7 skipped: not saved


def test_spike_guard_skips_a_step_far_above_the_recent_median(tmp_path, tiny_overrides):
    config = build_run_config(overrides=tiny_overrides + ["train.steps=16", "train.spike_factor=3", "train.spike_window=10"])
    train(config, tmp_path / "run", objective=Faulty(config, spike_steps=[14]))
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert rows[14]["skipped"] == "spike" and sum("skipped" in r for r in rows.values()) == 1


def test_z_loss_is_added_and_logged(tmp_path, tiny_overrides):
    train(build_run_config(overrides=tiny_overrides + ["train.z_loss=1e-3", "train.steps=2"]), tmp_path / "run")
    row = read_metrics(tmp_path / "run")[0]
    assert row["z_loss"] > 0 and row["loss"] == pytest.approx(row["ce"] + 1e-3 * row["z_loss"], rel=1e-5)


def test_tensorboard_event_files_mirror_the_metrics(tmp_path, tiny_overrides):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(build_run_config(overrides=tiny_overrides + ["train.steps=3"]), tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("loss")]
    assert logged == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "run")])
    assert json.loads((tmp_path / "run" / "result.json").read_text())["skipped_steps"] == 0
