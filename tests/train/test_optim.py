"""build_optimizer: fused AdamW where torch supports it, with the same update as the unfused one; lr_at: the
cosine and warmup-stable-decay schedules, their boundaries, and their restart in each phase."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ropelab.config import ConfigError, ModelConfig, TrainConfig, build_run_config
from ropelab.model import Transformer
from ropelab.train.optim import allocate_state, build_optimizer, fused_supported, lr_at


def tiny_model_twin_and_start() -> tuple[Transformer, Transformer, Transformer]:
    """A 1-layer model, a copy to train beside it, and a copy of the weights before either trains."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, n_layer=1, d_model=16, n_head=2, d_ff=32, max_seq_len=16))
    return model, copy.deepcopy(model), copy.deepcopy(model)


def train_side_by_side(pairs, steps: int = 3) -> None:
    """`steps` steps of each (model, optimizer) on the same tokens, alternating."""
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for net, optimizer in pairs:
            net(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()


def test_fused_adamw_takes_the_unfused_step():
    model, twin, start = tiny_model_twin_and_start()
    config = TrainConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(model, config)
    assert fused.defaults["fused"] is True
    plain = build_optimizer(twin, config)
    for group in plain.param_groups:
        group["fused"] = None  # the same groups and hyper-parameters, torch's default implementation
    train_side_by_side(((model, fused), (twin, plain)))
    for ours, theirs, before in zip(model.parameters(), twin.parameters(), start.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert not torch.equal(ours, before)


def test_fused_only_for_plain_float_tensors():
    assert fused_supported([torch.zeros(2, requires_grad=True)])
    assert not fused_supported([])
    assert not fused_supported([torch.zeros(2, device="meta")])


def test_wsd_values_at_the_phase_boundaries():
    config = TrainConfig(steps=100, lr=1.0, min_lr_ratio=0.1, warmup_fraction=0.05, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(step, config) for step in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]  # warm-up: 5 steps
    assert {lr_at(step, config) for step in range(5, 81)} == {1.0}  # stable, and the first step of the decay
    assert lr_at(81, config) == pytest.approx(1 - 0.9 * math.sqrt(1 / 20), rel=1e-12)
    assert lr_at(90, config) == pytest.approx(1 - 0.9 * math.sqrt(0.5), rel=1e-12)
    assert lr_at(99, config) == pytest.approx(1 - 0.9 * math.sqrt(19 / 20), rel=1e-12)
    assert lr_at(100, config) == lr_at(150, config) == 0.1  # the end and past it: the floor
    no_warmup = TrainConfig(steps=10, lr=2.0, min_lr_ratio=0.0, warmup_fraction=0.0, schedule="wsd", decay_fraction=0.5)
    assert [lr_at(step, no_warmup) for step in range(6)] == [2.0] * 6 and lr_at(10, no_warmup) == 0.0
    assert lr_at(5, no_warmup, total_steps=20) == 2.0 and lr_at(15, no_warmup, total_steps=20) < 2.0


def test_cosine_is_the_default_and_unchanged():
    config = TrainConfig(steps=100, lr=1.0, min_lr_ratio=0.1, warmup_fraction=0.1)
    assert config.schedule == "cosine" and config.decay_fraction == 0.1
    assert lr_at(9, config) == 1.0 and lr_at(10, config) == 1.0
    assert lr_at(55, config) == pytest.approx(0.55, rel=1e-12) and lr_at(100, config) == pytest.approx(0.1, rel=1e-12)
    assert lr_at(95, config) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 85 / 90)), rel=1e-12)


@pytest.mark.parametrize("steps, warmup, decay", [(1, 0.0, 0.1), (3, 0.34, 0.5), (7, 0.05, 0.1), (200, 0.05, 0.1),
                                                  (50, 0.0, 1.0), (64, 0.5, 0.5)])
def test_wsd_rises_holds_then_falls_to_the_floor(steps, warmup, decay):
    config = TrainConfig(steps=steps, lr=3e-4, min_lr_ratio=0.1, warmup_fraction=warmup, schedule="wsd",
                         decay_fraction=decay)
    config.validate()
    lrs = [lr_at(step, config) for step in range(steps + 1)]
    top = lrs.index(max(lrs))
    assert max(lrs) == 3e-4 and all(lr >= 3e-4 * 0.1 for lr in lrs[top:])
    assert all(a <= b for a, b in zip(lrs[:top], lrs[1:top + 1]))  # warm-up
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1:]))  # stable, then the decay
    assert lrs[-1] == 3e-4 * 0.1 and lrs[-2] > lrs[-1]  # a decay of at least one step


def test_wsd_restarts_in_each_phase(tmp_path, tiny_overrides):
    from ropelab.train.loop import train
    from ropelab.train.metrics import read_metrics

    phases = {"train": {"schedule": "wsd", "decay_fraction": 0.5, "warmup_fraction": 0.25, "phases": [
        {"name": "a", "steps": 4}, {"name": "b", "steps": 4, "overrides": {"train.lr": 1e-3}}]}}
    config = build_run_config(phases, overrides=tiny_overrides + ["train.eval_every=100"])
    train(config, tmp_path / "run")
    lr = [row["lr"] for row in read_metrics(tmp_path / "run")]
    # each phase of 4 steps: 1 warm-up step, 1 stable, 2 of decay (1 - sqrt(0), 1 - sqrt(1/2)) towards 10%
    decayed = 1 - 0.9 * math.sqrt(0.5)
    assert lr == pytest.approx([3e-3, 3e-3, 3e-3, 3e-3 * decayed, 1e-3, 1e-3, 1e-3, 1e-3 * decayed], rel=1e-12)


@pytest.mark.parametrize("override, message", [
    ("train.schedule=linear", "train.schedule='linear': must be one of 'cosine', 'wsd', 'constant'"),
    ("train.decay_fraction=0", "train.decay_fraction=0.0: must be in (0, 1]"),
    ("train.decay_fraction=1.5", "train.decay_fraction=1.5: must be in (0, 1]"),
])
def test_bad_schedule_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        build_run_config(overrides=[override])
    assert str(info.value) == message


def test_wsd_warmup_and_decay_must_fit_in_the_run():
    overrides = ["train.schedule=wsd", "train.warmup_fraction=0.5", "train.decay_fraction=0.6"]
    with pytest.raises(ConfigError, match=r"^train.decay_fraction=0.6: with a warm-up of 0.5 of the steps, .* <= 1\)$"):
        build_run_config(overrides=overrides)
    build_run_config(overrides=overrides[:2] + ["train.decay_fraction=0.5"])
    build_run_config(overrides=["train.warmup_fraction=0.5", "train.decay_fraction=0.6"])  # cosine ignores it


def test_allocated_state_trains_exactly_as_the_lazily_made_one():
    model, twin, start = tiny_model_twin_and_start()
    config = TrainConfig(lr=1e-2, weight_decay=0.1)
    eager, lazy = build_optimizer(model, config), build_optimizer(twin, config)
    allocate_state(eager)
    assert len(eager.state) == len(list(model.parameters())) and not lazy.state
    for p, before in zip(model.parameters(), start.parameters(), strict=True):
        assert torch.equal(p, before) and p.grad is None
        state = eager.state[p]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert [g["lr"] for g in eager.param_groups] == [1e-2, 1e-2]
    train_side_by_side(((model, eager), (twin, lazy)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    state = {k: v.clone() for k, v in eager.state[next(model.parameters())].items()}
    allocate_state(eager)  # state already there: nothing changes
    assert all(torch.equal(v, eager.state[next(model.parameters())][k]) for k, v in state.items())


def test_constant_schedule_and_warmup_steps_and_a_linear_decay():
    constant = TrainConfig(steps=10, lr=1.0, warmup_steps=2, schedule="constant")
    assert [lr_at(step, constant) for step in range(10)] == [0.5, 1.0] + [1.0] * 8
    linear = TrainConfig(steps=10, lr=1.0, min_lr_ratio=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.5,
                         decay_shape="linear")
    assert [lr_at(step, linear) for step in range(10)] == pytest.approx([1.0] * 5 + [1.0, 0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ConfigError, match="train.warmup_steps=10: must be in"):
        TrainConfig(steps=10, warmup_steps=10).validate()
