"""Fault 5: non-finite losses for more consecutive steps than train.max_bad_steps (2 here), then a
resume without the fault."""

import pytest
import torch

from ropelab.config import build_run_config
from ropelab.errors import TrainingDiverged
from ropelab.sources.runs import read_result
from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics
from ropelab.train.objectives import build_objective

from .helpers import assert_intact, assert_same_run, fault_overrides, listing, step_dir


class NaNFrom:
    """The run's own objective, with a NaN loss from step `first` on (1-based; one micro-batch a step)."""

    def __init__(self, config, first: int):
        self.objective = build_objective(config, torch.device("cpu"))
        self.first, self.calls = first, 0

    def __call__(self, model, batch):
        self.calls += 1
        loss, logged = self.objective(model, batch)
        return (loss * float("nan") if self.calls >= self.first else loss), logged


# first bad step -> the checkpoint the stop names: the newest one followed by an applied step
CASES = {6: 4, 5: 2}


@pytest.mark.parametrize("first_bad", list(CASES))
def test_bad_steps_stop_the_run_and_a_resume_finishes(tmp_path, tiny_overrides, reference, first_bad):
    run, good = tmp_path / "run", step_dir(tmp_path / "run", CASES[first_bad])
    config = build_run_config(overrides=fault_overrides(tiny_overrides))
    stop = first_bad + 1  # the second bad step
    with pytest.raises(TrainingDiverged) as err:
        train(config, run, objective=NaNFrom(config, first_bad))
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"{run}: 2 consecutive bad steps (last: non-finite at step {stop}); "
                       f"the last good checkpoint is {good}")
    assert read_result(run) is None
    assert listing(run) == ["step_00000002", "step_00000004"]  # nothing saved from the skipped steps
    assert_intact(good)
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "skipped" in r] == list(range(first_bad, stop + 1))
    # resumed without the fault, from the newest checkpoint or from the one the stop named
    result = train(out_dir=run, resume=True, from_checkpoint=None if good == ckpt.latest_checkpoint(run) else good)
    assert result.skipped_steps == 0
    assert_same_run(run, reference)
