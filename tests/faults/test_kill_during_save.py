"""Fault 2: the trainer SIGKILLed at each stage of writing the checkpoint of step 6, and while pruning
after it (kill_in_save.py, in a child process); then a resume in this process."""

import signal
import subprocess

import pytest

from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train

from .helpers import (
    assert_intact, assert_same_run, fault_overrides, listing, script_cmd, step_dir, tmp_dir, worker_env,
)

PARTIAL = [".tmp_step_00000006", "step_00000002", "step_00000004"]
# stage -> (what the checkpoints folder holds after the kill, files the partial step-6 folder holds, files it lacks)
STAGES = {
    "shards": (PARTIAL, ["dcp/.metadata", "dcp/__0_0.distcp"], ["model.safetensors"]),
    "weights": (PARTIAL, ["model.safetensors", "rng_rank0.pt"], ["state.pt"]),
    "state": (PARTIAL, ["state.pt"], ["CHECKSUMS.json"]),
    "manifest": (PARTIAL, ["CHECKSUMS.json"], ["COMPLETE"]),
    "rename": (PARTIAL, ["COMPLETE"], []),
    "prune": (["step_00000004", "step_00000006"], [], []),
    "mid_prune": (["step_00000002", "step_00000004", "step_00000006"], [], []),
}


def kill_while_saving(run, tiny, stage):
    env = worker_env({"CRASH_RUN": str(run), "CRASH_STEP": "6", "CRASH_STAGE": stage})
    done = subprocess.run(script_cmd("kill_in_save.py", "train", "--out", run, *fault_overrides(tiny)),
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    assert not (run / "result.json").exists()
    return done


@pytest.mark.parametrize("stage", list(STAGES))
def test_sigkill_while_saving_loses_nothing(tmp_path, tiny_overrides, reference, stage):
    run = tmp_path / "run"
    kill_while_saving(run, tiny_overrides, stage)
    left, present, absent = STAGES[stage]
    assert listing(run) == left  # the kill happened where intended
    for name in present:
        assert (tmp_dir(run, 6) / name).is_file(), (name, listing(run))
    for name in absent:
        assert not (tmp_dir(run, 6) / name).exists(), name
    newest = step_dir(run, 6) if stage in ("prune", "mid_prune") else step_dir(run, 4)
    assert ckpt.latest_checkpoint(run) == newest
    assert ckpt.latest_intact_checkpoint(run) == (newest, [])
    assert_intact(step_dir(run, 4))  # the previous checkpoint
    assert_intact(newest)
    if stage == "mid_prune":  # the half-deleted old one is incomplete: never the newest, pruned next time
        assert (step_dir(run, 2) / ckpt.MARKER).is_file() and not (step_dir(run, 2) / "dcp").exists()
    train(out_dir=run, resume=True)
    assert_same_run(run, reference)
    assert listing(run) == ["step_00000006", "step_00000008"]
