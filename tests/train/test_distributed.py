"""torchrun on CPU (gloo, 2 processes): DDP and FSDP2 against one process with gradient
accumulation standing in for the second rank; crashes and resumes of a 2-process job."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ropelab.config import ConfigError, build_run_config
from ropelab.sources import load
from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics

STEPS = 10
HERE = Path(__file__).parent


def overrides(tiny):
    return tiny + [f"train.steps={STEPS}", "train.checkpoint_every=2", "train.eval_every=5", "train.keep_checkpoints=10"]


def torchrun_cmd(run_dir, args, script=None):
    target = [str(script)] if script else ["-m", "ropelab"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *target,
            "train", "--out", str(run_dir), "--no-progress", *args]


def worker_env(extra=None):
    """Read when a job starts, not at import, so that the session's ROPELAB_CACHE (set by a fixture) reaches the ranks."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def torchrun(run_dir, args, script=None, env=None):
    return subprocess.run(torchrun_cmd(run_dir, args, script), capture_output=True, env=worker_env(env), timeout=300)


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def final_weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, tiny_session_overrides):
    run = tmp_path_factory.mktemp("ddp") / "run"
    done = torchrun(run, overrides(list(tiny_session_overrides)))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return run


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory, tiny_session_overrides):
    run = tmp_path_factory.mktemp("one") / "run"
    train(build_run_config(overrides=overrides(list(tiny_session_overrides)) + ["train.grad_accum=2"]), run)
    return run


def assert_same_run(a, b, atol):
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == STEPS
    assert max(abs(x - y) for x, y in zip(la, lb)) <= atol
    # validation is split across the ranks: the same windows, the same mean
    va, vb = ([(r["step"], r["val_loss"]) for r in read_metrics(run) if "val_loss" in r] for run in (a, b))
    assert [s for s, _ in va] == [s for s, _ in vb] == [5, 10]
    assert max(abs(x - y) for (_, x), (_, y) in zip(va, vb)) <= atol
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], rtol=0, atol=atol), name


def test_ddp_two_processes_match_one_process_with_accumulation(ddp_reference, one_process_reference):
    assert_same_run(ddp_reference, one_process_reference, atol=1e-5)
    state = ckpt.read_state(ckpt.latest_checkpoint(ddp_reference))
    assert state["world"] == 2 and sorted(p.name for p in ckpt.latest_checkpoint(ddp_reference).glob("rng_rank*")) == [
        "rng_rank0.pt", "rng_rank1.pt"]


def test_fsdp_two_processes_match_one_process_with_accumulation(tmp_path, tiny_overrides, one_process_reference):
    run = tmp_path / "fsdp"
    done = torchrun(run, overrides(tiny_overrides) + ["train.parallel=fsdp"])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert_same_run(run, one_process_reference, atol=1e-5)
    # Only the last checkpoint gathered the weights into model.safetensors; the others load from their shards.
    with_file = [p.name for p in ckpt.list_checkpoints(run) if (p / ckpt.WEIGHTS).is_file()]
    assert with_file == [f"step_{STEPS:08d}"]
    sharded, _, _ = load(ckpt.step_dir(run, 4))
    reference, _, _ = load(ckpt.step_dir(one_process_reference, 4))
    for (name, a), b in zip(sharded.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), name


def test_sigkill_at_a_random_step_then_resume_is_bitwise_equal(tmp_path, tiny_overrides, ddp_reference):
    run = tmp_path / "run"
    kill_after = random.Random(0).randint(3, STEPS - 3)
    proc = subprocess.Popen(torchrun_cmd(run, overrides(tiny_overrides)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=worker_env(), start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (read_metrics(run) and read_metrics(run)[-1]["step"] >= kill_after):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, as a lost node would
    proc.wait(timeout=60)
    assert not (run / "result.json").exists()
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and ckpt.read_state(latest)["step"] < STEPS
    done = torchrun(run, ["--resume"])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert losses(run) == losses(ddp_reference)
    wa, wb = final_weights(run), final_weights(ddp_reference)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_crash_while_writing_a_checkpoint_never_loads_it(tmp_path, tiny_overrides, ddp_reference):
    run = tmp_path / "run"
    done = torchrun(run, overrides(tiny_overrides), script=HERE / "crash_in_save.py",
                    env={"CRASH_RUN": str(run), "CRASH_STEP": "6"})
    saved = sorted(p.name for p in ckpt.checkpoint_dir(run).iterdir())
    assert done.returncode != 0, saved
    assert (ckpt.checkpoint_dir(run) / ".tmp_step_00000006" / "dcp").is_dir(), (saved, done.stderr.decode()[-3000:])
    assert ckpt.latest_checkpoint(run).name == "step_00000004", (saved, done.stderr.decode()[-3000:])
    done = torchrun(run, ["--resume"])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert not list(ckpt.checkpoint_dir(run).glob(".tmp_step_*"))
    assert losses(run) == losses(ddp_reference), (losses(run), losses(ddp_reference))
    wa, wb = final_weights(run), final_weights(ddp_reference)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_on_another_world_size_needs_the_same_global_batch(tmp_path, ddp_reference, one_process_reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ddp_reference, run)
    for later in ckpt.list_checkpoints(run)[2:]:
        shutil.rmtree(later)
    (run / "result.json").unlink()
    with pytest.raises(ConfigError, match="global batch 8"):
        train(out_dir=run, resume=True)  # one process, grad_accum 1: global batch 4
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["grad_accum"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    train(out_dir=run, resume=True)  # DCP reshards the 2-rank checkpoint onto one process
    assert_same_run(run, one_process_reference, atol=1e-5)
