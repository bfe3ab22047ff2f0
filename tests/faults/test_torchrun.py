"""Fault 6: a 2-process torchrun job (gloo, CPU) with one rank SIGKILLed in the middle of writing the
checkpoint of step 6 (kill_in_save.py with CRASH_RANK), or stopped by a signal (issue #29); then a
2-process resume."""

import subprocess

import pytest
import torch

from ropelab.sources.runs import read_result
from ropelab.train import checkpoint as ckpt

from .helpers import (
    assert_intact, final_weights, fault_overrides, listing, losses, step_dir, tmp_dir, torchrun_cmd, worker_env,
)


def torchrun(run, args, script=None, env=None):
    return subprocess.run(torchrun_cmd(run, args, script), capture_output=True, env=worker_env(env), timeout=300)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, tiny_session_overrides):
    run = tmp_path_factory.mktemp("ddp") / "run"
    done = torchrun(run, fault_overrides(tiny_session_overrides))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return run


# (rank killed, stage of the step-6 save, files of the partial folder on disk by then)
KILLS = {
    "rank1-after-its-shards": ("1", "shards", ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"]),
    "rank0-before-the-rename": ("0", "rename", ["COMPLETE", "CHECKSUMS.json", "rng_rank0.pt", "rng_rank1.pt"]),
}


def assert_same_as(run, reference):
    assert losses(run) == losses(reference)
    assert read_result(run)["final_val_loss"] == read_result(reference)["final_val_loss"]
    got, want = final_weights(run), final_weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert listing(run) == ["step_00000006", "step_00000008"]


@pytest.mark.parametrize("kill", list(KILLS))
def test_one_rank_killed_mid_save(tmp_path, tiny_overrides, ddp_reference, kill):
    rank, stage, present = KILLS[kill]
    run = tmp_path / "run"
    done = torchrun(run, fault_overrides(tiny_overrides), script="kill_in_save.py",
                    env={"CRASH_RUN": str(run), "CRASH_STEP": "6", "CRASH_STAGE": stage, "CRASH_RANK": rank})
    stderr = done.stderr.decode()[-3000:]
    assert done.returncode != 0, stderr  # the job dies with its rank
    assert read_result(run) is None
    assert listing(run) == [".tmp_step_00000006", "step_00000002", "step_00000004"], stderr
    for name in present:
        assert (tmp_dir(run, 6) / name).is_file(), (name, stderr)
    assert ckpt.latest_intact_checkpoint(run) == (step_dir(run, 4), [])
    assert_intact(step_dir(run, 4))
    assert ckpt.read_state(step_dir(run, 4))["world"] == 2
    done = torchrun(run, ["--resume"])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert_same_as(run, ddp_reference)


# after step 3: SIGTERM to torchrun's agent (as `kill`, Kubernetes or a cloud sends it), which forwards
# it to both ranks; or SIGUSR1 to rank 1 alone, which rank 0 learns of through the stop's all-reduce
STOPS = {
    "sigterm-to-torchrun": ({"STOP_PARENT": "1", "STOP_RANK": "0"}, "stopped by SIGTERM at step 3"),
    "sigusr1-to-rank1": ({"STOP_SIGNAL": "USR1", "STOP_RANK": "1"}, "stopped by a signal to another rank at step 3"),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_stop_signal_stops_every_rank_at_the_same_step(tmp_path, tiny_overrides, ddp_reference, stop):
    env, message = STOPS[stop]
    run = tmp_path / "run"
    done = torchrun(run, fault_overrides(tiny_overrides), script="kill_in_save.py", env={"STOP_AFTER_STEP": "3", **env})
    stderr = done.stderr.decode()
    assert done.returncode != 0, stderr[-3000:]  # torchrun's own code: the ranks exit 75
    lines = [line for line in stderr.splitlines() if line.startswith("ropelab:")]
    assert lines == [f"ropelab: {run}: {message}, checkpoint {step_dir(run, 3)}; resume with: ropelab train --out {run} --resume"]
    assert listing(run) == ["step_00000002", "step_00000003"]
    assert_intact(step_dir(run, 3))
    assert ckpt.read_state(step_dir(run, 3))["world"] == 2  # both ranks took part in the save
    done = torchrun(run, ["--resume"])
    assert done.returncode == 0, done.stderr.decode()[:3000]  # a rank's own error comes before torchrun's summary
    assert_same_as(run, ddp_reference)
