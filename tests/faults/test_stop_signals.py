"""Fault 7 (issue #29): the trainer stopped by SIGTERM or SIGUSR1 while it sets up, mid-run, during a
periodic save and during the save the stop itself makes, and SIGKILLed there (the grace period ran
out); kill_in_save.py in a child process, then a resume in this process."""

import subprocess

import pytest

from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.stop import EX_TEMPFAIL

from .helpers import (
    assert_intact, assert_one_line, assert_same_run, fault_overrides, listing, script_cmd, step_dir, worker_env,
)

# case -> (kill_in_save.py's environment, exit code, the step it stopped at (None: killed), checkpoints left)
CASES = {
    "sigterm-before-the-first-step": ({"STOP_AFTER_STEP": "0"}, EX_TEMPFAIL, 0, ["step_00000000"]),
    "sigterm-mid-run": ({"STOP_AFTER_STEP": "5"}, EX_TEMPFAIL, 5, ["step_00000004", "step_00000005"]),
    "sigusr1-mid-run": ({"STOP_AFTER_STEP": "3", "STOP_SIGNAL": "USR1"}, EX_TEMPFAIL, 3, ["step_00000002", "step_00000003"]),
    # during the periodic save of step 6: it completes, and the run stops right after it
    "sigterm-while-writing-shards": ({"CRASH_STEP": "6", "CRASH_STAGE": "shards", "CRASH_SIGNAL": "TERM"},
                                     EX_TEMPFAIL, 6, ["step_00000004", "step_00000006"]),
    # a second SIGTERM during the save the first one asked for: ignored, the save completes
    "second-sigterm-while-saving": ({"STOP_AFTER_STEP": "5", "CRASH_STEP": "5", "CRASH_STAGE": "weights", "CRASH_SIGNAL": "TERM"},
                                    EX_TEMPFAIL, 5, ["step_00000004", "step_00000005"]),
    # SIGTERM, then SIGKILL in the middle of that save: the partial folder is never loaded
    "sigkill-after-sigterm-while-saving": ({"STOP_AFTER_STEP": "5", "CRASH_STEP": "5", "CRASH_STAGE": "state"},
                                           -9, None, [".tmp_step_00000005", "step_00000002", "step_00000004"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stop_signal_then_resume_equals_the_uninterrupted_run(tmp_path, tiny_overrides, reference, case):
    env, code, stopped_at, left = CASES[case]
    run = tmp_path / "run"
    done = subprocess.run(script_cmd("kill_in_save.py", "train", "--out", run, *fault_overrides(tiny_overrides)),
                          capture_output=True, env=worker_env({"CRASH_RUN": str(run), **env}), timeout=300)
    stderr = done.stderr.decode()
    assert done.returncode == code, stderr[-3000:]
    assert listing(run) == left
    assert not (run / "result.json").exists()
    if stopped_at is not None:
        name = "SIGUSR1" if env.get("STOP_SIGNAL") == "USR1" else "SIGTERM"
        assert_one_line(stderr.splitlines(), f"stopped by {name} at step {stopped_at}", step_dir(run, stopped_at),
                        f"resume with: ropelab train --out {run} --resume")
    newest = step_dir(run, stopped_at if stopped_at is not None else 4)
    assert ckpt.latest_checkpoint(run) == newest
    assert_intact(newest)
    train(out_dir=run, resume=True)
    assert_same_run(run, reference)
    assert listing(run) == ["step_00000006", "step_00000008"]
